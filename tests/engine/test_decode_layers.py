"""A decode step's layers in one call into the C kernels (engine/models/decode_layers.py,
csrc/decode_step.c): the same logits and the same cache columns, bit for bit, as the kernel
step calling the kernels one by one from Python, for rows of different lengths (padding), on
one thread and on two, and on the next step too (the buffers' spare room reused); where the
caches are not for it, nothing is touched and the one-by-one step runs; where it fails
part-way, the step runs again one by one; a step of many rows keeps each row's bits; off, it
is not built."""

from __future__ import annotations

import pytest
import torch

from engine.executor import kv
from engine.executor.outputs import finish_row
from engine.models import lean_decode
from tests.engine.test_lean_decode import running_batch
from tests.engine.test_scheduler import prompts_of


@pytest.fixture
def runner(kernel_runner):
    return kernel_runner


@pytest.fixture
def new_batch(runner):
    """Prefills the test prompts (rows of different lengths) into a batch, finished after."""
    batches = []

    def make():
        batches.append(running_batch(runner, prompts_of("qwen2_5_vl")))
        return batches[-1]

    yield make
    for batch in batches:
        for row in batch.rows:
            finish_row(row, "abort")


def _inputs(batch, ahead: int = 0):
    """A decode step's ids, mask and positions, ``ahead`` steps past the batch's own."""
    rows = batch.rows
    ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long)
    mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1 + ahead))], dim=1)
    positions = torch.tensor([[r.position + ahead] for r in rows], dtype=torch.long)
    if batch.mrope:
        deltas = torch.tensor([[r.rope_delta] for r in rows], dtype=torch.long)
        positions = (positions + deltas).unsqueeze(0).expand(3, -1, -1)
    return ids, mask, positions


def _steps(runner, batch, whole, count: int = 2):
    """``count`` steps of the lean step with ``whole`` (None: one by one): each step's logits
    and every layer's keys and values after it; the cache left as it was."""
    step = runner._lean_decode
    kv.reserve(batch.cache)
    before = kv.snapshot(batch.cache)
    out = []
    try:
        with torch.inference_mode():
            for ahead in range(count):
                logits = step(*_inputs(batch, ahead), batch.cache, whole=whole)
                out.append((logits.clone(), [(layer.keys.clone(), layer.values.clone())
                                             for layer in batch.cache.layers]))
    finally:
        kv.restore(batch.cache, before)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_the_layers_in_one_call_are_the_one_by_one_steps_bits(runner, new_batch, threads):
    whole = runner._lean_decode.whole
    assert whole is not None
    ran = []

    def counted(*args):
        ran.append(whole(*args))
        return ran[-1]

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = new_batch()
        assert not bool(batch.mask.all())  # (rows of different lengths: padding)
        one_call = _steps(runner, batch, counted)
        one_by_one = _steps(runner, batch, None)
    finally:
        torch.set_num_threads(saved)
    assert ran == [True, True]
    for (logits, caches), (their_logits, their_caches) in zip(one_call, one_by_one, strict=True):
        assert torch.equal(logits, their_logits)
        assert all(torch.equal(k, their_k) and torch.equal(v, their_v)
                   for (k, v), (their_k, their_v) in zip(caches, their_caches, strict=True))
    assert one_call[1][1][0][0].shape[2] == one_call[0][1][0][0].shape[2] + 1


@pytest.mark.parametrize("threads", [1, 2])
def test_the_whole_step_in_one_call_is_the_layers_calls_bits(runner, new_batch, threads):
    """The embedding, the first norm, the layers and the head in one call (``ap_decode_step``)
    give the logits and cache columns of the layers in one call with the rest in Python."""
    whole = runner._lean_decode.whole
    assert whole.step is not None
    calls = []

    def layers_only(*args):  # (no ``step``: the layers' call, the rest in Python)
        return whole(*args)

    def with_step(*args):
        return whole(*args)

    def step(*args):
        calls.append(whole.step(*args))
        return calls[-1]

    with_step.step = step
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = new_batch()
        in_one = _steps(runner, batch, with_step)
        layers = _steps(runner, batch, layers_only)
    finally:
        torch.set_num_threads(saved)
    assert len(calls) == 2 and all(isinstance(c, torch.Tensor) for c in calls)
    for (logits, caches), (their_logits, their_caches) in zip(in_one, layers, strict=True):
        assert torch.equal(logits, their_logits)
        assert all(torch.equal(k, their_k) and torch.equal(v, their_v)
                   for (k, v), (their_k, their_v) in zip(caches, their_caches, strict=True))


def test_an_id_outside_the_table_touches_nothing_and_fails_as_the_embedding(runner, new_batch):
    batch = new_batch()
    whole = runner._lean_decode.whole
    ids, mask, positions = _inputs(batch)
    vocab = runner.model.get_input_embeddings().weight.shape[0]
    ids[-1, 0] = vocab + 5
    kv.reserve(batch.cache)
    keys = [layer.keys for layer in batch.cache.layers]
    dim = batch.cache.layers[0].keys.shape[-1]
    cos = sin = torch.ones(len(batch.rows), dim)
    with torch.inference_mode():
        assert whole.step(ids, cos, sin, mask.bool(), batch.cache) is False
        assert all(layer.keys is k for layer, k in zip(batch.cache.layers, keys, strict=True))
        with pytest.raises(IndexError):
            runner._lean_decode(ids, mask, positions, batch.cache)


def test_steps_in_a_row_reuse_the_records_and_keep_the_bits_past_a_buffers_end(runner,
                                                                               new_batch):
    """Steps in a row past the spare room of the cache buffers (so they are made again
    once): each step's logits and cache the bits of the one-by-one step's; the layers'
    records are set on the first step and when the buffers changed, not each step."""
    whole = runner._lean_decode.whole
    batch = new_batch()
    columns = batch.mask.shape[1]
    count = max(kv._SPARE_COLUMNS, (columns + 1) // 4) + 8  # (past the first buffers' room)
    start = whole.rebinds
    in_one = _steps(runner, batch, whole, count=count)
    rebinds = whole.rebinds - start
    one_by_one = _steps(runner, batch, None, count=count)
    for n, ((logits, caches), (their_logits, their_caches)) in enumerate(
            zip(in_one, one_by_one, strict=True)):
        assert torch.equal(logits, their_logits), n
        assert all(torch.equal(k, their_k) and torch.equal(v, their_v)
                   for (k, v), (their_k, their_v) in zip(caches, their_caches, strict=True)), n
    assert rebinds == 2, rebinds  # (the first step, then the buffers made again)


def test_caches_not_for_it_are_left_alone_and_the_step_runs_one_by_one(runner, new_batch):
    """Caches not turned into growing layers (kv.reserve), or a mask of another width: False,
    nothing touched; the step itself still runs (one by one) and gives the same logits."""
    batch = new_batch()
    whole = runner._lean_decode.whole
    rows, hidden = len(batch.rows), runner.model.config.get_text_config().hidden_size
    h, x = torch.randn(rows, hidden), torch.randn(rows, hidden)
    cos = sin = torch.ones(rows, 16)
    copies = (h.clone(), x.clone())
    keys = [layer.keys for layer in batch.cache.layers]
    _ids, mask, _positions = _inputs(batch)
    assert whole(h, x, cos, sin, mask.bool(), batch.cache) is False  # (not reserved)
    kv.reserve(batch.cache)
    assert whole(h, x, cos, sin, mask.bool()[:, 1:], batch.cache) is False  # (one short)
    assert whole(h, x, cos, sin, mask, batch.cache) is False  # (not bool)
    assert torch.equal(h, copies[0]) and torch.equal(x, copies[1])
    assert all(layer.keys is k for layer, k in zip(batch.cache.layers, keys, strict=True))


def test_a_failure_part_way_runs_the_step_again_one_by_one(runner, new_batch):
    batch = new_batch()
    whole = runner._lean_decode.whole

    def fails(h, x, *args):
        h.fill_(float("nan"))  # (what a part-way run leaves: not the step's)
        x.fill_(float("nan"))
        return None

    failed = _steps(runner, batch, fails, count=1)
    assert torch.equal(failed[0][0], _steps(runner, batch, whole, count=1)[0][0])
    assert not bool(failed[0][0].isnan().any())


@pytest.mark.parametrize("whole_step", [False, True])
def test_a_step_of_many_rows_runs_in_one_call_and_each_row_keeps_its_bits(runner, whole_step):
    """A step of 70 rows (``--max-num-seqs`` past 64, whose steps once went to oneDNN's
    products) runs the layers in one call (and, ``whole_step``, the embedding and the head
    too), and each row's logits are the bits of the same row in a step of its prompt's few
    (the products' sums do not change with the rows)."""
    whole = runner._lean_decode.whole
    ran = []

    def counted(*args):
        ran.append(whole(*args))
        return ran[-1]

    def step(*args):
        ran.append(whole.step(*args))
        return ran[-1]

    if whole_step:
        counted.step = step
    prompts = prompts_of("qwen2_5_vl")
    batches = []
    try:
        batches.append(running_batch(runner, prompts))
        batches.append(running_batch(runner, prompts * (70 // len(prompts) + 1)))
        assert len(batches[1].rows) >= 70
        few = _steps(runner, batches[0], counted, count=1)[0][0]
        many = _steps(runner, batches[1], counted, count=1)[0][0]
    finally:
        for batch in batches:
            for row in batch.rows:
                finish_row(row, "abort")
    if whole_step:
        assert len(ran) == 2 and all(isinstance(r, torch.Tensor) for r in ran)
    else:
        assert ran == [True, True]
    for i in range(many.shape[0]):
        assert torch.equal(many[i], few[i % len(prompts)]), i


@pytest.mark.parametrize("variable", ["APHRODITE_DECODE_STEP_KERNEL",
                                      "APHRODITE_DECODE_ATTENTION_KERNEL"])
def test_off_it_is_not_built(runner, monkeypatch, variable):
    """Off, or with the attention kernel off (the one-by-one step then runs attention as
    batched products, which the call would not)."""
    monkeypatch.setenv(variable, "0")
    step = lean_decode.for_model(runner.model)
    assert step.kernel_products > 0 and step.whole is None
