"""The decode step's fast path (``runner._decode_at``, the lean step's ``at``,
``ap_decode_step_at``): the rows' tokens and positions go in as lists, the rotary cos and sin
are gathered in the C call from the rotary table, each row's greedy token comes out of it,
the mask grows in buffers with room and the caches' views are made only when read. The same
logits bit for bit and the same tokens as the tensor path over steps past the caches' and
the mask's room and the rotary table's blocks; the greedy tokens taken only where nothing
changes the logits before the sampler; where the call does not take a step, nothing is
touched."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.executor import kv
from engine.executor.outputs import finish_row
from engine.executor.sampling import SamplingParams
from engine.models import decode_kernels, rope_table
from tests.engine.test_lean_decode import running_batch
from tests.engine.test_scheduler import prompts_of


@pytest.fixture
def runner(kernel_runner):
    return kernel_runner


def _batch(runner, params: SamplingParams):
    """The test prompts (rows of different lengths, padding) prefilled into one batch."""
    return running_batch(runner, prompts_of("qwen2_5_vl"), params)


def _finish(batch) -> None:
    for row in batch.rows:
        finish_row(row, "abort")


def _decode(runner, batch, steps: int, fast: bool) -> tuple[list, int]:
    """``steps`` of ``runner.decode`` (``fast``: the fast path where it takes a step, else
    the tensor path only): each step's logits, and how many steps the fast path took."""
    seen, taken = [], []
    advance, at = runner._advance, runner._lean_decode.at

    def recording(rows, logits, greedy=None):
        seen.append(logits.clone())
        return advance(rows, logits, greedy)

    def counted(*args):
        out = at(*args) if fast else False
        taken.append(bool(out))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "_advance", recording)
        patch.setattr(runner._lean_decode, "at", counted)
        for _ in range(steps):
            runner.decode(batch)
    return seen, sum(taken)


def test_the_fast_path_is_the_tensor_paths_bits_over_many_steps(runner):
    """Past the cache buffers' spare room, the mask's and a 64-position block of the rotary
    table: every step's logits and every row's tokens are the tensor path's; the fast path
    took all but the steps it had to leave (the first, buffers made again, a table block)."""
    steps = kv._SPARE_COLUMNS + rope_table.BLOCK + 10
    params = SamplingParams(max_tokens=steps + 5, temperature=0, ignore_eos=True)
    batches = [_batch(runner, params), _batch(runner, params)]
    try:
        assert not bool(batches[0].mask.all())  # (padding)
        fast, taken = _decode(runner, batches[0], steps, fast=True)
        slow, none = _decode(runner, batches[1], steps, fast=False)
        assert none == 0 and steps - 6 <= taken < steps, taken
        for n, (a, b) in enumerate(zip(fast, slow, strict=True)):
            assert torch.equal(a, b), n
        for a, b in zip(batches[0].rows, batches[1].rows, strict=True):
            assert a.token_ids == b.token_ids and len(a.token_ids) == steps + 1
        assert torch.equal(batches[0].mask, batches[1].mask)
        for a, b in zip(batches[0].cache.layers, batches[1].cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        for batch in batches:
            _finish(batch)


def test_a_position_past_the_table_or_other_caches_touch_nothing(runner):
    """``at`` on a position the rotary table does not hold yet, or on caches whose records
    the last step did not leave: False, and the caches and rows are as they were."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batch = _batch(runner, params)
    try:
        runner.decode(batch)  # (the tensor path fills the table, binds the records)
        runner.decode(batch)
        at = runner._lean_decode.at
        rows = batch.rows
        positions = [r.position + r.rope_delta for r in rows]
        keys = [(layer.keys, layer.values) for layer in batch.cache.layers]
        keep, columns = batch.next_keep()
        tokens = [r.last_token for r in rows]
        far = [*positions[:-1], 1 << 20]
        assert at(tokens, far, 3, keep, columns, batch.cache) is False
        other = batch.split(rows)  # (the same rows in other buffers)
        kv.reserve(other.cache)
        assert at(tokens, positions, 3, keep, columns, other.cache) is False
        assert at(tokens, positions, 3, keep, columns - 1, batch.cache) is False  # (short)
        assert all(layer.keys is k and layer.values is v
                   for layer, (k, v) in zip(batch.cache.layers, keys, strict=True))
        out = at(tokens, positions, 3, keep, columns, batch.cache)  # (the real one takes it)
        assert isinstance(out, tuple) and out[1] == out[0].max(dim=-1).indices.tolist()
    finally:
        _finish(batch)


def test_greedy_tokens_are_taken_only_where_nothing_changes_the_logits(runner):
    """``_advance`` takes the step's greedy tokens for rows that are all greedy without a
    processor; a row with a repetition penalty (or sampling) sends them to the sampler."""
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batch = _batch(runner, plain)
    try:
        rows = batch.rows
        vocab = runner.model.config.get_text_config().vocab_size
        logits = torch.zeros(len(rows), vocab)
        logits[:, 5] = 1.0  # (the sampler's token: 5)
        hint = [7] * len(rows)  # (not the logits' argmax: which one was taken shows)
        runner._advance(rows, logits, hint)
        assert [r.token_ids[-1] for r in rows] == hint
        rows[0].request.params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                repetition_penalty=1.5)
        runner._advance(rows, logits, hint)
        assert [r.token_ids[-1] for r in rows] == [5] * len(rows)
    finally:
        _finish(batch)


def test_argmax_rows_is_torch_maxs_index():
    """The first maximal value's index, the first NaN's where a row has one, ties and
    infinities as torch.max(dim=-1) gives them."""
    lib = decode_kernels.prepare()
    if lib is None:
        pytest.skip("no C compiler on this machine")
    lib = decode_kernels.ops()
    nan, inf = float("nan"), float("inf")
    x = torch.randn(12, 300, generator=torch.Generator().manual_seed(1))
    x[1, 40] = x[1, 200] = x[1].max() + 1  # (a tie: the first)
    x[2, 17] = x[2, 250] = nan
    x[3, 0] = nan
    x[4] = -inf
    x[5, 10] = x[5, 20] = inf
    x[5, 30] = nan
    x[6] = 0.0
    x[6, 99] = -0.0
    x[7, 299] = 100.0  # (the last)
    out = (ctypes.c_int64 * 12)()
    lib.ap_argmax_rows(x.data_ptr(), 12, 300, ctypes.addressof(out))
    assert list(out) == x.max(dim=-1).indices.tolist()
    assert list(out)[1:4] == [40, 17, 0]


def test_the_mask_grows_in_its_buffers_until_replaced(runner):
    """``next_keep`` gives the mask as bools with a column of ones in a buffer with room;
    taken, the batch's mask is that mask and the next call writes into the same buffers; a
    mask set otherwise (rows leaving) is copied into new ones, its values kept."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batch = _batch(runner, params)
    try:
        start = batch.mask.clone()
        keep, columns = batch.next_keep()
        grown = torch.cat([start, torch.ones(len(batch.rows), 1, dtype=start.dtype)], dim=1)
        assert columns == start.shape[1] + 1 and keep.dtype == torch.bool
        assert torch.equal(keep[:, :columns], grown != 0)
        batch.took(columns)
        assert torch.equal(batch.mask, grown) and batch.mask.dtype == start.dtype
        again, more = batch.next_keep()
        assert again is keep and more == columns + 1 and bool(again[:, columns].all())
        batch.took(more)
        assert torch.equal(batch.mask[:, :-1], grown) and bool(batch.mask[:, -1].all())
        buffer = batch.mask.untyped_storage().data_ptr()
        batch.keep(batch.rows[1:])  # (the first row leaves: the mask is another tensor)
        left, last = batch.next_keep()
        assert left is not keep and last == batch.mask.shape[1] + 1
        assert torch.equal(left[:, :last - 1], batch.mask != 0)
        batch.took(last)
        assert batch.mask.untyped_storage().data_ptr() != buffer
    finally:
        _finish(batch)


def test_grown_layers_make_their_views_when_read():
    """After ``grow`` the keys and values are the buffers' used columns when read; until
    then the layer still holds its buffers; anything set replaces them (and ``holds`` is
    False), a copy of a grown layer reads its own views."""
    import copy

    import transformers as T

    config = T.Qwen2Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128)
    gen = torch.Generator().manual_seed(0)
    cache = T.DynamicCache(config=config)
    first = torch.randn(2, 2, 5, 16, generator=gen)
    cache.layers[0].update(first, first + 1)
    kv.reserve(cache)
    layer = cache.layers[0]
    kbuf, vbuf, used = layer.room(3)
    cols = torch.randn(2, 2, 3, 16, generator=gen)
    kbuf[..., used:used + 3, :] = cols
    vbuf[..., used:used + 3, :] = cols + 1
    layer.grow(2)
    layer.grow(1)
    assert layer.holds(kbuf, vbuf)
    twin = copy.copy(layer)
    expect = torch.cat([first, cols], dim=-2)
    assert torch.equal(layer.keys, expect) and torch.equal(layer.values, expect + 1)
    assert layer.keys.data_ptr() == kbuf.data_ptr() and layer.holds(kbuf, vbuf)
    assert torch.equal(twin.values, expect + 1) and twin.get_seq_length() == 8
    layer.values = layer.values.clone()
    assert not layer.holds(kbuf, vbuf) and torch.equal(layer.keys, expect)
