"""Vision attention over packed spans (engine/models/vision_attention.py): the engine's vision
encoders give exactly the output of transformers' own SDPA path (one call per window), for
every family that attends by spans, on media whose windows come in several lengths; the
function itself against one SDPA call per span, with spans of one length apart from each other;
and what it leaves to plain SDPA."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.models import attention, vision_attention
from tests.engine_fixtures import llm
from tests.fixtures import synthetic

torch = pytest.importorskip("torch")
SPAN_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


def _per_span(query, key, value, bounds, scale=None):
    """transformers' SDPA path: one SDPA call per span."""
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale)
        for a, b in itertools.pairwise(bounds)]
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_spans_of_one_length_apart_from_each_other_give_per_span_sdpa():
    gen = torch.Generator().manual_seed(0)
    # lengths 64, 16, 64, 64, 40, 16, 64: the 64s are not one run; 16s and 40 alone too
    lengths = [64, 16, 64, 64, 40, 16, 64]
    bounds = [0, *np.cumsum(lengths).tolist()]
    q, k, v = (torch.randn(1, 4, bounds[-1], 8, generator=gen) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.inference_mode():
        out, _ = vision_attention.attention(None, q, k, v, None, scaling=0.3, is_causal=False,
                                            cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                            max_length_q=64, max_length_k=64)
        ref = _per_span(q, k, v, bounds, scale=0.3)
    assert out.shape == (1, bounds[-1], 4, 8)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # one run of equal spans (a full-attention layer over frames of one size): views only
    even = [0, 32, 64, 96]
    with torch.inference_mode():
        out, _ = vision_attention.attention(None, q[:, :, :96], k[:, :, :96], v[:, :, :96],
                                            None, cu_seq_lens_q=torch.tensor(even))
    torch.testing.assert_close(out, _per_span(q[:, :, :96], k[:, :, :96], v[:, :, :96], even),
                               atol=1e-6, rtol=1e-6)


def test_without_bounds_it_is_plain_sdpa_and_bad_bounds_are_refused():
    """No bounds: attention over all the tokens, as transformers' SDPA does. Bounds that do
    not tile the tokens in order are an error (transformers' own path fails to split by
    them), never a guess. Grouped key/value heads take one SDPA call per span."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=gen) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    module = torch.nn.Module()
    module.is_causal = False
    with torch.inference_mode():
        out, _ = vision_attention.attention(module, q, k, v, None, is_causal=False)
        torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)
        for bounds in ([0, 8, 4, 20], [0, 8, 16], [4, 20]):
            with pytest.raises(ValueError, match="do not tile"):
                vision_attention.attention(module, q, k, v, None,
                                           cu_seq_lens_q=torch.tensor(bounds))
        module.num_key_value_groups = 2  # 4 query heads over 2 key/value heads
        q4 = torch.randn(1, 4, 20, 8, generator=gen)
        out, _ = vision_attention.attention(module, q4, k, v, None, is_causal=False,
                                            cu_seq_lens_q=torch.tensor([0, 12, 20]))
        heads = [torch.nn.functional.scaled_dot_product_attention(
            q4[:, :, a:b], k[:, :, a:b].repeat_interleave(2, 1),
            v[:, :, a:b].repeat_interleave(2, 1)) for a, b in ((0, 12), (12, 20))]
        torch.testing.assert_close(out, torch.cat(heads, dim=2).transpose(1, 2), atol=1e-6,
                                   rtol=1e-6)


@pytest.mark.parametrize("arch", SPAN_FAMILIES)
def test_a_familys_vision_encoder_gives_transformers_sdpa_output(arch):
    """Images of sizes that leave edge windows (and a video) through the loaded model's
    encoder: bit for bit what the same encoder gives with transformers' SDPA span by span.
    Only the vision config is switched; the text model keeps the engine's SDPA."""
    from engine.processing import device_normalize
    from engine.processing.preprocess import MediaItem

    model = llm(arch)
    runner = model.engine.runner
    net = runner.model
    vision = net.config.vision_config
    assert vision._attn_implementation == vision_attention.NAME
    assert net.config.text_config._attn_implementation == attention.NAME
    spec = model.loaded.spec
    items = [MediaItem("image", decoded=synthetic.image_array(200, 136, 1)),
             MediaItem("image", decoded=synthetic.image_array(96, 64, 2)),
             MediaItem("video", decoded=np.stack([synthetic.video_frame(i, 120, 72)
                                                  for i in range(4)]))]
    text = "Look: " + 2 * spec.placeholders["image"] + spec.placeholders["video"] + " Now?"
    prompt = model.prepare(text, items, None, False)[1]
    mm = device_normalize.apply(prompt.mm, runner.normalizers)
    encoder = net.model.visual
    calls: list = []
    real = vision_attention.attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q"))
        return real(*args, **kwargs)

    from transformers import AttentionInterface

    def encode():
        with torch.inference_mode():
            return [encoder(mm[pixels], grid_thw=mm[grid]) for pixels, grid in (
                ("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))]

    AttentionInterface.register(vision_attention.NAME, counted)
    try:
        ours = encode()
    finally:
        AttentionInterface.register(vision_attention.NAME, real)
    assert calls and all(c is not None for c in calls)  # one call per layer, with the spans
    assert any(len(set(torch.diff(c).tolist())) > 1 for c in calls)  # spans of several lengths
    vision._attn_implementation = attention.NAME
    try:
        theirs = encode()
    finally:
        vision._attn_implementation = vision_attention.NAME
    for a, b in zip(ours, theirs, strict=True):
        a = a.pooler_output if getattr(a, "pooler_output", None) is not None else a[0]
        b = b.pooler_output if getattr(b, "pooler_output", None) is not None else b[0]
        assert torch.equal(a, b)
