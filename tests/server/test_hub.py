"""Models from a Hugging Face Hub id: downloaded from a loopback fake Hub (tests/fake_hub.py,
``HF_ENDPOINT``) into the Hugging Face cache, only the files a model needs, then served;
offline the cache alone is used; every failure is one line naming the repo.

In-process tests point the already imported huggingface_hub at the fake (``patch_client``);
the end-to-end test runs ``aphrodite serve ORG/NAME`` with the environment a user would set.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.errors import ConfigError
from engine.models.loader import load_model, resolve_model_path
from tests.fake_hub import FakeHub
from tests.fixtures import synthetic
from tests.server_harness import ServerProcess

BIN = Path(sys.executable).with_name("aphrodite")


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL folder as a repo would hold it, plus what a model does not need:
    a README, a training script, and the same weights again as a ``.bin``."""
    folder = tmp_path_factory.mktemp("repo") / "tiny-vl"
    shutil.copytree(resolve_model_path("tiny:qwen2_vl"), folder)
    (folder / "README.md").write_text("# tiny\n")
    (folder / "train.py").write_text("print('not needed')\n")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 1024)
    return folder


def set_offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_downloads_what_the_model_needs_and_loads(hub, tiny_repo, tmp_path):
    hub.add_repo("acme/tiny-vl", tiny_repo)
    loaded = load_model("acme/tiny-vl")
    assert loaded.name == "acme/tiny-vl" and loaded.spec.name == "qwen2_vl"
    assert loaded.path.is_relative_to(tmp_path / "hf" / "hub")  # the Hugging Face cache
    assert sorted(hub.downloads()) == sorted(
        p.name for p in tiny_repo.iterdir()
        if p.name not in ("README.md", "train.py", "pytorch_model.bin"))
    assert (loaded.path / "model.safetensors").read_bytes() == \
        (tiny_repo / "model.safetensors").read_bytes()
    assert loaded.processor.__class__.__name__ == "Qwen2VLProcessor"


def test_bin_weights_only_for_a_repo_without_safetensors(hub, tiny_repo, tmp_path):
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny_repo, legacy, ignore=shutil.ignore_patterns("*.safetensors"))
    hub.add_repo("acme/legacy", legacy)
    resolve_model_path("acme/legacy")
    assert "pytorch_model.bin" in hub.downloads()


def test_no_weights_fetches_the_processor_files_only(hub, tiny_repo):
    """What `bench mm-processor --model ORG/NAME --no-encoder` loads: the real processor,
    without downloading any weights."""
    hub.add_repo("acme/tiny-vl", tiny_repo)
    loaded = load_model("acme/tiny-vl", weights=False)
    assert loaded.processor.__class__.__name__ == "Qwen2VLProcessor"
    assert (loaded.path / "tokenizer.json").is_file()
    assert not any(name.endswith((".safetensors", ".bin")) for name in hub.downloads())


def test_a_download_dir_and_a_revision(hub, tiny_repo, tmp_path):
    sha = hub.add_repo("acme/tiny-vl", tiny_repo)
    folder = resolve_model_path("acme/tiny-vl", revision=sha,
                                download_dir=str(tmp_path / "models"))
    assert folder.is_relative_to(tmp_path / "models") and folder.name == sha
    with pytest.raises(ConfigError) as info:
        resolve_model_path("acme/tiny-vl", revision="v9")
    assert info.value.code == "model_revision_not_found"
    assert "'v9'" in info.value.message and "acme/tiny-vl" in info.value.message


def test_offline_uses_the_cache_without_a_request(hub, tiny_repo, monkeypatch):
    hub.add_repo("acme/tiny-vl", tiny_repo)
    online = resolve_model_path("acme/tiny-vl")
    asked = len(hub.requests)
    set_offline(monkeypatch)
    assert resolve_model_path("acme/tiny-vl") == online
    assert len(hub.requests) == asked
    with pytest.raises(ConfigError) as info:
        resolve_model_path("acme/never-downloaded")
    assert info.value.code == "model_not_found"
    assert "HF_HUB_OFFLINE" in info.value.message and "acme/never-downloaded" in \
        info.value.message


def test_missing_and_gated_repos_are_one_line_each(hub, tiny_repo, monkeypatch):
    hub.add_repo("acme/gated", tiny_repo, gated=True, token="hf_secret")
    with pytest.raises(ConfigError) as info:
        resolve_model_path("acme/nothing-here")
    assert info.value.code == "model_not_found" and "acme/nothing-here" in info.value.message
    assert hub.endpoint in info.value.message  # which Hub was asked
    with pytest.raises(ConfigError) as info:
        resolve_model_path("acme/gated")
    assert info.value.code == "model_gated" and "HF_TOKEN" in info.value.hint
    assert hub.downloads() == []
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # the user's token, read at call time
    assert (resolve_model_path("acme/gated") / "config.json").is_file()


def test_an_unreachable_hub_is_named(monkeypatch, tmp_path):
    with FakeHub() as fake:
        fake.patch_client(monkeypatch, tmp_path / "hf")
        endpoint = fake.endpoint
    # the fake is closed: nothing listens on its port any more
    with pytest.raises(ConfigError) as info:
        resolve_model_path("acme/tiny-vl")
    assert info.value.code == "model_hub_unreachable"
    assert endpoint in info.value.message and "acme/tiny-vl" in info.value.message


@pytest.mark.timeout(300)
def test_serve_downloads_a_hub_model_then_starts_offline_from_the_cache(tiny_repo, tmp_path):
    """What a user runs: ``HF_ENDPOINT=... aphrodite serve acme/tiny-vl``; the model is
    downloaded once, answers an image request under its hub name, and a second start with
    ``HF_HUB_OFFLINE=1`` asks the Hub nothing. A gated repo fails with one line."""
    with FakeHub() as fake:
        fake.add_repo("acme/tiny-vl", tiny_repo)
        fake.add_repo("acme/gated", tiny_repo, gated=True, token="hf_secret")
        env = fake.client_env(tmp_path / "hf")
        server = ServerProcess("acme/tiny-vl", env=env).wait_ready()
        try:
            client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
            assert [m.id for m in client.models.list()] == ["acme/tiny-vl"]
            png = synthetic.make_image(32, 32, fmt="PNG")
            reply = client.chat.completions.create(
                model="acme/tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                    {"type": "text", "text": "What is this?"}]}], extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 2
        finally:
            assert server.stop() == 0
        assert "model.safetensors" in fake.downloads()
        asked = len(fake.requests)

        server = ServerProcess("acme/tiny-vl", env={**env, "HF_HUB_OFFLINE": "1"}).wait_ready()
        try:
            with urllib.request.urlopen(f"{server.base}/health") as resp:
                assert resp.status == 200
        finally:
            assert server.stop() == 0
        assert len(fake.requests) == asked

        done = subprocess.run([str(BIN), "model", "download", "acme/gated"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2  # a configuration error, like any bad model argument
        assert "acme/gated" in done.stdout + done.stderr and "HF_TOKEN" in done.stdout + \
            done.stderr
        assert "Traceback" not in done.stdout + done.stderr


def test_mm_processor_on_a_hub_model_without_weights_records_repo_commit_and_tokens(
        hub, tiny_repo):
    """`bench mm-processor --model ORG/NAME --no-encoder`: the real processor from the Hub, no
    weights fetched; the result names the repo, the commit it ran and the processor classes,
    and the tokens per image are what one call of that processor gives the same image size."""
    import numpy as np

    from aphrodite_cli.bench.data.datasets import parse_buckets
    from aphrodite_cli.bench.offline.mm_processor import run_mm_processor

    sha = hub.add_repo("acme/tiny-vl", tiny_repo)
    doc = run_mm_processor("acme/tiny-vl", num_prompts=2, encoder=False, mode="cold",
                           buckets=parse_buckets('{"240,320,1": 1}'))
    assert not any(name.endswith((".safetensors", ".bin")) for name in hub.downloads())
    source = doc["source"]
    assert (source["repo"], source["commit"], source["processor"]) == (
        "acme/tiny-vl", sha, "Qwen2VLProcessor")
    assert source["image_processor"] == "Qwen2VLImageProcessor"
    processor = load_model("acme/tiny-vl", weights=False).processor
    ref = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"],
                    images=[np.zeros((240, 320, 3), np.uint8)], return_tensors="np")
    expected = int((ref["input_ids"][0] == processor.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>")).sum())
    assert doc["tokens_per_item"]["image"]["median"] == expected
    assert doc["tokens_per_item"]["image"]["count"] == 2
