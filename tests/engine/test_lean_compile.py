"""``--compile-decode`` (engine.models.lean_compile) on the tiny Qwen2.5-VL: a compiled
bucket's logits are the eager lean step's within float rounding (inductor may sum in another
order), rows padded up to the bucket included; a bucket not compiled yet runs the eager step
bit for bit and compiles nothing inside the step; a compiled bucket runs without compiling
again; an engine started with it answers while its compiles run in the background and
after them (compiled), with the model's own generate logits."""

from __future__ import annotations

import pytest
import torch

from engine.executor.outputs import finish_row
from engine.models import lean_compile, lean_decode, parts
from tests.engine.test_lean_decode import one_step_logits, running_batch
from tests.engine.test_scheduler import greedy, prompts_of
from tests.engine_fixtures import llm

#: the bound on a compiled step's logits, relative to their largest magnitude (the fused
#: products' own bound in test_lean_decode)
BOUND = 1e-5


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled_step(runner, rows: int) -> lean_compile.CompiledStep:
    text = parts.language_model(runner.model)
    step = lean_decode._step(text, list(text.layers), runner.model.get_output_embeddings(),
                             compile_rows=rows)
    assert isinstance(step, lean_compile.CompiledStep)
    return step


@pytest.mark.parametrize("packed", [False, True], ids=["plain-products", "onednn-products"])
def test_a_compiled_bucket_gives_the_eager_logits_within_rounding(monkeypatch, packed):
    if packed:  # every fused weight packed: the products go through the custom operator
        monkeypatch.setenv("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", "0")
    runner = llm("qwen2_5_vl").engine.runner
    step = compiled_step(runner, 8)
    assert step.buckets == [1, 2, 4, 8]
    batch = running_batch(runner, prompts_of("qwen2_5_vl"))
    batch.keep(batch.rows[:3])  # 3 rows of different lengths: padded to the bucket of 4
    assert not bool(batch.mask.all())
    monkeypatch.setattr(runner, "_lean_decode", step)
    try:
        eager = one_step_logits(runner, batch, lean=True)  # (nothing compiled: eager)
        assert step.ready == set()
        step.compile_bucket(4)
        assert step.ready == {4}
        before = graphs_compiled()
        compiled = one_step_logits(runner, batch, lean=True)
        again = one_step_logits(runner, batch, lean=True)
        assert graphs_compiled() == before  # the step compiled nothing: the bucket was ready
        step.enabled = False
        assert torch.equal(one_step_logits(runner, batch, lean=True), eager)
    finally:
        for row in batch.rows:
            finish_row(row, "abort")
    assert compiled.shape == eager.shape == (3, eager.shape[1])
    assert not torch.equal(compiled, torch.zeros_like(compiled))
    assert float((compiled - eager).abs().max()) <= BOUND * float(eager.abs().max())
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    assert torch.equal(again, compiled)


def test_a_bucket_not_compiled_runs_the_eager_step_and_compiles_nothing(monkeypatch):
    runner = llm("qwen2_5_vl").engine.runner
    eager_step = runner._lean_decode
    step = compiled_step(runner, 2)
    batch = running_batch(runner, prompts_of("qwen2_5_vl")[:1])
    try:
        want = one_step_logits(runner, batch, lean=True)
        monkeypatch.setattr(runner, "_lean_decode", step)
        before = graphs_compiled()
        got = one_step_logits(runner, batch, lean=True)
        assert graphs_compiled() == before and step.ready == set()
    finally:
        for row in batch.rows:
            finish_row(row, "abort")
    assert eager_step is not step and torch.equal(got, want)


def test_an_engine_compiling_in_the_background_answers_meanwhile_and_after():
    """Requests sent while the compiles run are answered (by the eager step until a bucket
    is ready), and those sent after by the compiled one without compiling: both keep the
    model's own generate logits (within the engine tests' 1e-4)."""
    from engine.config import EngineConfig
    from engine.executor.engine import Engine
    from engine.executor.request import EngineRequest
    from tests.engine.test_scheduler import assert_generate_logits, record_logits

    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=1, compile_decode=True,
                                               num_threads=1))
    prompts = prompts_of("qwen2_5_vl")[:2]
    try:
        step = engine.runner._lean_decode
        assert engine.runner.decode_path == "lean-compiled"
        logits = record_logits(engine)

        def answered() -> None:
            reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in prompts]
            for req in reqs:
                assert req.done.wait(120) and req.error is None, req.error
            for req, prompt in zip(reqs, prompts, strict=True):
                assert_generate_logits(engine, logits, req, prompt, 4)

        answered()  # (while bucket 1 compiles on the background thread)
        assert step.wait(600) and step.error is None and step.ready == {1}
        before, runs = graphs_compiled(), []
        compiled = step._compiled
        step._compiled = lambda *args: runs.append(args[0]) or compiled(*args)
        answered()  # (compiled)
        assert graphs_compiled() == before and runs and set(runs) == {1}
    finally:
        engine.close()
    assert step._stop.is_set()  # (closing the engine stops further compiles)


@pytest.mark.parametrize("change", ["activation", "epsilon"])
def test_a_model_the_compiled_step_cannot_run_keeps_the_eager_step(monkeypatch, caplog, change):
    runner = llm("qwen2_5_vl").engine.runner
    text = parts.language_model(runner.model)
    if change == "activation":
        monkeypatch.setattr(text.config, "hidden_act", "gelu")
    else:  # (one graph serves every layer: their norms must agree)
        monkeypatch.setattr(text.layers[-1].post_attention_layernorm, "variance_epsilon", 1e-3)
    step = lean_decode._step(text, list(text.layers), runner.model.get_output_embeddings(),
                             compile_rows=4)
    assert not isinstance(step, lean_compile.CompiledStep) and callable(step)
    assert "--compile-decode: the eager decode step runs" in caplog.text
