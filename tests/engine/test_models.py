"""Registry, tiny builders, model resolution."""

from __future__ import annotations

import hashlib
import json

import pytest

from engine.errors import ConfigError
from engine.models.loader import load_model, resolve_model_path
from engine.models.registry import REGISTRY, arch_for_config, get_arch
from tests.engine_fixtures import FAMILIES


def test_required_families_are_registered():
    assert set(FAMILIES) <= set(REGISTRY)
    assert get_arch("Qwen2.5-VL").name == "qwen2_5_vl"
    assert REGISTRY["llava"].modalities == ("image",)
    assert REGISTRY["qwen2_audio"].modalities == ("audio",)
    assert not REGISTRY["llava"].ships_chat_template
    assert get_arch("Qwen3-VL").name == "qwen3_vl" and REGISTRY["qwen3_vl"].video_timestamps
    assert arch_for_config({"architectures": ["Qwen3VLForConditionalGeneration"]},
                           "x").name == "qwen3_vl"
    for arch, model_class in (("llava_onevision", "LlavaOnevisionForConditionalGeneration"),
                              ("internvl", "InternVLForConditionalGeneration")):
        assert REGISTRY[arch].modalities == ("image", "video")
        assert REGISTRY[arch].ships_chat_template
        assert arch_for_config({"architectures": [model_class]}, "x").name == arch
    assert get_arch("LLaVA-OneVision").name == "llava_onevision"
    assert REGISTRY["gemma3"].modalities == ("image",) and REGISTRY["gemma3"].ships_chat_template
    assert arch_for_config({"model_type": "gemma3"}, "x").name == "gemma3"
    smol = REGISTRY["smolvlm"]
    assert smol.modalities == ("image", "video") and smol.one_visual_modality
    assert arch_for_config({"architectures": ["SmolVLMForConditionalGeneration"]},
                           "x") is smol


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ConfigError) as info:
        load_model(str(tmp_path))
    for arch in ("Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration",
                 "Qwen2AudioForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
        assert arch in info.value.message
    with pytest.raises(ConfigError, match="supported: qwen2_5_vl"):
        get_arch("gpt2")
    assert arch_for_config({"model_type": "qwen2_vl"}, "x").name == "qwen2_vl"


def _weights_hash(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "llava_onevision", "internvl",
                                  "gemma3", "smolvlm"])
def test_make_tiny_is_deterministic_and_uses_real_classes(tmp_path, arch):
    spec = REGISTRY[arch]
    spec.build_tiny(tmp_path / "a", seed=0)
    spec.build_tiny(tmp_path / "b", seed=0)
    spec.build_tiny(tmp_path / "c", seed=1)
    assert _weights_hash(tmp_path / "a") == _weights_hash(tmp_path / "b")
    assert _weights_hash(tmp_path / "a") != _weights_hash(tmp_path / "c")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == [spec.model_class] and spec.model_types == (
        config["model_type"],)
    processor = json.loads((tmp_path / "a" / "processor_config.json").read_text())
    assert processor["processor_class"] == spec.processor_class


@pytest.mark.timeout(30)
def test_hub_id_not_cached_fails_fast_without_network(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ConfigError) as info:
        resolve_model_path("llava-hf/llava-1.5-7b-hf")
    assert "not in the Hugging Face cache" in info.value.message
    assert info.value.code == "model_not_found"


def test_local_folder_and_hf_cache_load_the_same_way(tmp_path, monkeypatch):
    """A model copied into a Hugging Face cache layout resolves through the same loader."""
    import shutil

    source = resolve_model_path("tiny:qwen2_vl")
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny-qwen2-vl" / "snapshots" / ("0" * 40)
    shutil.copytree(source, snap)
    (hub / "models--acme--tiny-qwen2-vl" / "refs").mkdir()
    (hub / "models--acme--tiny-qwen2-vl" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    cached = load_model("acme/tiny-qwen2-vl")
    local = load_model(str(source))
    assert cached.spec.name == local.spec.name == "qwen2_vl"
    assert cached.path.resolve() == snap.resolve()
    assert cached.name == "acme/tiny-qwen2-vl"


def test_llava_has_no_chat_template_until_given_one():
    from engine.models.templates_path import template_path

    bare = load_model("tiny:llava")
    assert bare.chat_template is None
    with_template = load_model("tiny:llava", chat_template=str(template_path("llava")))
    assert "USER:" in with_template.chat_template
    with pytest.raises(ConfigError, match="is not a file"):
        load_model("tiny:llava", chat_template="/nonexistent/template.jinja")


def test_make_tiny_head_dim_32_through_the_cli_loads_and_generates(tmp_path):
    """``make-tiny --head-dim 32`` (vLLM's CPU attention refuses 16): the text width and the
    M-RoPE sections follow the head size, and the engine loads and generates with it."""
    from typer.testing import CliRunner

    from aphrodite_cli.main import app
    from engine import LLM, SamplingParams
    from tests.engine.test_llm import frames, img

    folder = tmp_path / "tiny32"
    result = CliRunner().invoke(app, ["model", "make-tiny", "qwen2_5_vl", "--head-dim", "32",
                                      "--out", str(folder)])
    assert result.exit_code == 0, result.output
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert text.get("head_dim", 32) == 32
    assert sum(text["rope_parameters"]["mrope_section"]) == 16
    model = LLM(str(folder))
    try:
        out = model.generate({"prompt": "Describe them.", "multi_modal_data": {
            "image": img(), "video": frames()}}, SamplingParams(max_tokens=4, temperature=0,
                                                                 ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        model.close()
    bad = CliRunner().invoke(app, ["model", "make-tiny", "qwen2_5_vl", "--head-dim", "33",
                                   "--out", str(tmp_path / "odd")])
    assert bad.exit_code != 0 and not (tmp_path / "odd").exists()
    # the cached tiny:ARCH models the other tests use keep head_dim 16
    cached = json.loads((resolve_model_path("tiny:qwen2_5_vl") / "config.json").read_text())
    assert cached["text_config"]["hidden_size"] == 64
    assert cached["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


@pytest.mark.parametrize("arch", ["llava_onevision", "internvl", "gemma3", "smolvlm"])
def test_tiny_vlm_builders_take_another_head_dim_and_generate(tmp_path, arch):
    """``head_dim`` reaches the text model of the builders in tiny_vlm.py (width 4 x head_dim,
    the projector out to it), and the engine loads and generates with each modality."""
    from engine import LLM, SamplingParams
    from engine.models.tiny import build_tiny
    from tests.engine.test_llm import frames, img

    build_tiny(arch, tmp_path / "m", head_dim=32)
    text = json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert text.get("head_dim", 32) == 32
    model = LLM(str(tmp_path / "m"))
    try:
        media = {"image": img(), "video": frames()}
        spec = REGISTRY[arch]
        # all modalities in one prompt, or one at a time where the family takes one (SmolVLM)
        groups = ([[m] for m in spec.modalities] if spec.one_visual_modality
                  else [spec.modalities])
        for group in groups:
            out = model.generate({"prompt": "Describe them.", "multi_modal_data": {
                m: media[m] for m in group}}, SamplingParams(
                    max_tokens=3, temperature=0, ignore_eos=True))
            assert len(out[0].outputs[0].token_ids) == 3
    finally:
        model.close()


def test_model_list_names_each_familys_own_processor_kwargs_and_the_server_accepts_them():
    """``model list`` (no model loaded) names the kwargs each family's processor adds; every
    one is a key --mm-processor-kwargs accepts on that family's loaded processor."""
    from typer.testing import CliRunner

    from aphrodite_cli.main import app
    from engine.processing.kwargs import accepted_kwargs
    from tests.engine_fixtures import loaded

    result = CliRunner().invoke(app, ["model", "list", "--output-format", "json"])
    assert result.exit_code == 0, result.output
    rows = {row["family"]: row for row in json.loads(result.output)}
    assert set(rows) == set(REGISTRY)
    own = {family: [k for k in row["own processor kwargs"].split(", ") if k != "-"]
           for family, row in rows.items()}
    assert "max_pixels" in own["qwen2_5_vl"] and "do_pan_and_scan" in own["gemma3"]
    assert "do_image_splitting" in own["smolvlm"] and "max_patches" in own["internvl"]
    for family in FAMILIES:
        assert set(own[family]) <= accepted_kwargs(loaded(family).processor), family
