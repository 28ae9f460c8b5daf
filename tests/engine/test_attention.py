"""The engine's attention (engine/models/attention.py): without the decode kernel
(``APHRODITE_DECODE_ATTENTION_KERNEL=0``, or no compiler; the kernel's own tests are in
test_decode_kernels.py), a CPU decode step over rows of very different lengths attends each row
over its own columns, with SDPA's results, and one over the whole frame is two grouped products
with SDPA's results; anything else is SDPA itself; a decode step's mask is the padding mask
itself; every family's decode logits stay those of the model's own ``generate``."""

from __future__ import annotations

import pytest

from engine.models import attention, decode_kernels
from tests.engine.test_scheduler import assert_generate_logits, greedy, media_item, record_logits
from tests.engine_fixtures import FAMILIES, llm

torch = pytest.importorskip("torch")
sdpa_module = pytest.importorskip("transformers.integrations.sdpa_attention")


@pytest.fixture
def no_kernel(monkeypatch):
    """The decode kernel off: the paths it replaces where it is built."""
    monkeypatch.setenv("APHRODITE_DECODE_ATTENTION_KERNEL", "0")


class _Module:
    num_key_value_groups = 3
    is_causal = True


def _spy(monkeypatch, owner=sdpa_module, name="sdpa_attention_forward", first: int = 1) -> list:
    """(rows, key columns) of each call of ``owner.name``, whose query and key are its
    arguments ``first`` and ``first + 1``."""
    calls: list = []
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        query, key = args[first:first + 2]
        calls.append((query.shape[0], key.shape[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _spy_copies(monkeypatch) -> list:
    """Each key/value copy per query head (transformers' ``repeat_kv``) made."""
    copies: list = []
    real = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv",
                        lambda hidden, n_rep: copies.append(n_rep) or real(hidden, n_rep))
    return copies


def _inputs(lengths: list[int], width: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(lengths), 12, 1, 16, generator=gen)
    k = torch.randn(len(lengths), 4, width, 16, generator=gen)
    v = torch.randn(len(lengths), 4, width, 16, generator=gen)
    mask = torch.zeros(len(lengths), 1, 1, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, ..., width - n:] = True
    return q, k, v, mask


def test_rows_of_very_different_lengths_attend_over_their_own_columns(monkeypatch, no_kernel):
    q, k, v, mask = _inputs([40, 300, 45, 38], 300)
    # 3/4 of the frame is padding, 0.40 MB of keys and values per layer
    monkeypatch.setattr(attention, "MIN_WASTE_BYTES", 300_000)
    expected = sdpa_module.sdpa_attention_forward(_Module(), q, k, v, mask)[0]
    calls = _spy(monkeypatch)
    out = attention.attention(_Module(), q, k, v, mask)[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert calls == [(1, 40), (1, 300), (1, 45), (1, 38)]  # each row over its own columns
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out = attention.attention(_Module(), q, k, v, float_mask)[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["prefill", "no mask", "one row"])
def test_anything_else_is_sdpa_itself(monkeypatch, case, no_kernel):
    q, k, v, mask = _inputs([290, 300, 280, 295], 300)
    if case == "prefill":
        q = torch.randn(4, 12, 7, 16)
        mask = mask.expand(4, 1, 7, 300)
    if case == "no mask":
        mask = None
    if case == "one row":
        q, k, v, mask = q[:1], k[:1], v[:1], mask[:1]
    calls = _spy(monkeypatch)
    out = attention.attention(_Module(), q, k, v, mask)[0]
    assert calls == [(q.shape[0], 300)]
    assert out.shape == (q.shape[0], q.shape[2], 12, 16)


@pytest.mark.parametrize("case", ["little padding", "not right-aligned", "padding of few bytes"])
def test_a_decode_step_over_the_whole_frame_is_two_grouped_products(monkeypatch, case,
                                                                    no_kernel):
    """A CPU decode step whose rows do not go apart: each key/value head's group of query
    heads in one product over the frame, SDPA's result without a call of it and without
    copying a key/value head per query head (1.6x SDPA's at 8 rows x 300 columns here)."""
    q, k, v, mask = _inputs([290, 300, 280, 295], 300)
    if case == "not right-aligned":
        q, k, v, mask = _inputs([40, 300, 45, 38], 300)
        mask[0, ..., -1] = False  # a hole at the end: not one run up to the last column
        monkeypatch.setattr(attention, "MIN_WASTE_BYTES", 300_000)
    if case == "padding of few bytes":  # 3/4 of the frame, but 0.40 MB: a call per row costs more
        q, k, v, mask = _inputs([40, 300, 45, 38], 300)
        monkeypatch.setattr(attention, "MIN_WASTE_BYTES", 500_000)
    expected = sdpa_module.sdpa_attention_forward(_Module(), q, k, v, mask)[0]
    scaled = sdpa_module.sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.5)[0]
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    calls, copies = _spy(monkeypatch), _spy_copies(monkeypatch)
    torch.testing.assert_close(attention.attention(_Module(), q, k, v, mask)[0], expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention.attention(_Module(), q, k, v, float_mask)[0],
                               expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention.attention(_Module(), q, k, v, mask, scaling=0.5)[0],
                               scaled, atol=1e-5, rtol=1e-5)
    assert calls == [] and copies == []
    attention.attention(_Module(), torch.randn(4, 12, 7, 16), k, v, mask.expand(4, 1, 7, 300))
    assert copies == [3, 3]  # a prefill's are (the check can fail)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_decodes_rows_of_different_lengths_with_generates_logits(arch,
                                                                             monkeypatch):
    """A short text row and a long row with the family's media decoding together: each row's
    logits are those of the model's own ``generate`` on it alone."""
    from engine.config import EngineConfig
    from engine.executor.engine import Engine
    from engine.executor.request import EngineRequest

    model = llm(arch)
    spec = model.loaded.spec
    modality = spec.modalities[0]
    # (not a prompt of 3 tokens: a tiny random model may pick EOS early, which the engine
    # feeds on with ignore_eos while generate's min_new_tokens forbids it)
    short = model.prepare("Hi there, how are you doing today? Tell me.", [], None, False)[1]
    long = model.prepare("Look at this, every part of it, slowly. " * 3
                         + spec.placeholders[modality] + " What is it? " * 6,
                         [media_item(modality, 2)], None, False)[1]
    assert len(long.input_ids) > 2 * len(short.input_ids)
    monkeypatch.setattr(attention, "MIN_WASTE_BYTES", 0)  # the tiny models' padding is small
    engine = Engine(model.loaded, EngineConfig(enable_prefix_caching=False), batch_wait_s=1.0)
    assert engine.runner.model.config._attn_implementation in (attention.NAME, "eager")
    calls = _spy(monkeypatch)
    kernel_calls = _spy(monkeypatch, decode_kernels, "decode_attention", first=0)
    logits = record_logits(engine)
    try:
        reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in (short, long)]
        for req in reqs:
            assert req.done.wait(120) and req.error is None, req.error
        ours = engine.runner.model.config._attn_implementation == attention.NAME
        if ours and decode_kernels.library() is not None:  # (both rows, the short one padded)
            assert any(rows == 2 for rows, _ in kernel_calls), "no decode step ran the kernel"
        elif ours:
            assert any(rows == 1 for rows, _ in calls), "no decode step went row by row"
        for req, prompt in zip(reqs, (short, long), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
    finally:
        engine.close()


@pytest.mark.parametrize("q_length,kv_length,q_offset",
                         [(1, 6, 5), (1, 7, 6), (3, 6, 3), (1, 6, 2)])
def test_a_decode_steps_mask_is_the_padding_mask_itself(q_length, kv_length, q_offset):
    """One query at the last column: the padding mask, no mask function run per column; any
    other query (a prefill's, or one that may not see every column) gets SDPA's mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    args = {"q_length": q_length, "kv_length": kv_length, "q_offset": q_offset,
            "mask_function": causal_mask_function, "attention_mask": padding}
    ours = attention.mask(2, **args, allow_is_causal_skip=False)
    expected = sdpa_mask(2, **args, allow_is_causal_skip=False)
    assert torch.equal(ours.expand_as(expected), expected)
    is_view = ours.untyped_storage().data_ptr() == padding.untyped_storage().data_ptr()
    assert is_view == (q_length == 1 and q_offset == kv_length - 1 and kv_length == 6)
