"""``--decode-threads`` (llama.cpp's ``--threads`` beside ``--threads-batch``): the engine's
decode steps run on their own torch thread count, its prefills and encoders on
``--num-threads``, on a real tiny model; outputs stay those of the model's own ``generate``,
and the flag's conflicts are refused with errors naming the flags."""

from __future__ import annotations

import pytest

from engine.config import MIN_OVERLAP_PARAMETERS, EngineConfig
from engine.errors import ConfigError
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from tests.engine_fixtures import llm
from tests.test_scheduler import assert_generate_logits, greedy, prompts_of, record_logits


def watch_threads(engine: Engine) -> dict[str, set[int]]:
    """The torch thread counts each of the runner's prefills and decode steps ran with."""
    import torch

    seen: dict[str, set[int]] = {"prefill": set(), "decode": set()}
    runner = engine.runner
    prefill, decode = runner.prefill, runner.decode

    def watched_prefill(rows):
        seen["prefill"].add(torch.get_num_threads())
        return prefill(rows)

    def watched_decode(batch):
        seen["decode"].add(torch.get_num_threads())
        return decode(batch)

    runner.prefill, runner.decode = watched_prefill, watched_decode
    return seen


def test_decode_steps_run_on_decode_threads_and_prefills_on_num_threads():
    import torch

    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=4, num_threads=2,
                                               decode_threads=1))
    try:
        assert engine._prefiller is None  # no prefill beside the steps: one thread setting
        seen = watch_threads(engine)
        logits = record_logits(engine)
        prompts = prompts_of("qwen2_5_vl")
        lengths = [12 + 3 * i for i in range(len(prompts))]
        requests = [engine.submit(EngineRequest(p, greedy(n)))
                    for p, n in zip(prompts, lengths, strict=True)]
        for req in requests:
            assert req.done.wait(120) and req.error is None, req.error
        assert seen == {"prefill": {2}, "decode": {1}}
        assert torch.get_num_threads() == 2  # put back after every step
        for req, prompt, n in zip(requests, prompts, lengths, strict=True):
            assert len(req.outputs[0].token_ids) == n
            assert_generate_logits(engine, logits, req, prompt, n)
    finally:
        engine.close()


def test_without_decode_threads_every_step_runs_on_num_threads():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=4, num_threads=2))
    try:
        seen = watch_threads(engine)
        req = engine.submit(EngineRequest(prompts_of("qwen2_5_vl")[0], greedy(5)))
        assert req.done.wait(120) and req.error is None, req.error
        assert seen == {"prefill": {2}, "decode": {2}}
    finally:
        engine.close()


def test_decode_threads_turn_the_overlap_off_and_are_refused_beside_it():
    big = MIN_OVERLAP_PARAMETERS
    assert EngineConfig(num_threads=1).overlaps_prefill(2, big)
    # torch's thread count is one per process: a prefill beside would run on the steps'
    assert not EngineConfig(num_threads=1, decode_threads=1).overlaps_prefill(2, big)
    assert not EngineConfig(decode_threads=1, overlap_prefill=False).overlaps_prefill(2, big)
    with pytest.raises(ConfigError, match="--decode-threads and --overlap-prefill") as err:
        EngineConfig(decode_threads=1, overlap_prefill=True)
    assert "drop --overlap-prefill" in (err.value.hint or "")
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ConfigError, match="--decode-threads must be a whole number"):
            EngineConfig(decode_threads=bad)  # type: ignore[arg-type]
