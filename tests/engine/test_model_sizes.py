"""`aphrodite model make-tiny --size`: the larger random-weight Qwen2.5-VL the peer
comparison measures how cost grows with, and the combinations it refuses."""

from __future__ import annotations

import json

import pytest

from tests.server.test_cli import run


@pytest.mark.parametrize(("args", "message"), [
    (["llava", "--size", "small"], "--size small is built for qwen2_5_vl only, not llava"),
    (["qwen2_5_vl", "--size", "medium", "--head-dim", "32"],
     "--head-dim 32 applies to --size tiny only"),
    (["qwen2_5_vl", "--size", "huge"], "huge"),
])
def test_sizes_that_cannot_be_built_are_refused_before_building(tmp_path, args, message):
    done = run("model", "make-tiny", *args, "--out", str(tmp_path / "m"))
    assert done.returncode != 0
    assert message in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "m").exists()


def test_the_small_size_is_a_real_qwen2_5_vl_of_the_stated_shape(tmp_path):
    """Built by the CLI, loaded by transformers: the text and vision towers have the small
    size's layers, widths and heads (about 43 M parameters), and it generates."""
    import torch
    import transformers

    folder = tmp_path / "small"
    done = run("model", "make-tiny", "qwen2_5_vl", "--size", "small", "--out", str(folder))
    assert done.returncode == 0, done.stderr
    config = json.loads((folder / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_attention_heads"],
            text["num_key_value_heads"]) == (8, 512, 8, 2)
    assert text["hidden_size"] // text["num_attention_heads"] == 64
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (2, 640, 512)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    assert 38e6 < params < 48e6, params
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5)
