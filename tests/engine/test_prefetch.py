"""A prompt's positions and normalized media prepared on the prefetch thread while the engine
steps other rows (engine.executor.prefetch), on real tiny models: the rows still get
``generate``'s logits, the prefill takes what was prepared instead of computing it again, a
prefetch that raises costs nothing but the time, no more than AHEAD waiting requests hold
prepared inputs, and a prompt's normalized media are dropped once its prefill read them."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.executor import prefetch
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from tests.engine.test_scheduler import (
    after_tokens,
    assert_generate_logits,
    greedy,
    prompts_of,
    record_logits,
)
from tests.engine_fixtures import llm

ONE_ROW = EngineConfig(max_num_seqs=1)  # every other request waits while one runs


@contextlib.contextmanager
def one_row_engine(arch: str = "qwen2_5_vl"):
    """An engine on ``arch``'s tiny model running one row at a time, closed after."""
    engine = Engine(llm(arch).loaded, ONE_ROW)
    try:
        yield engine
    finally:
        engine.close()


def calls_by_thread(engine: Engine, part: str) -> dict[str, int]:
    """Counts the prefetcher's calls of ``part`` ("_positions" or "_media", the runner's
    methods it was given) per thread: the prefetch thread's or the engine's."""
    seen: dict[str, int] = {}
    fetcher = engine.runner.prefetcher
    inner = getattr(fetcher, part)

    def counting(prompt):
        thread = threading.current_thread().name.split("_")[0]
        seen[thread] = seen.get(thread, 0) + 1
        return inner(prompt)

    setattr(fetcher, part, counting)
    return seen


def behind_a_running_row(engine: Engine, first, rest: list, tokens: int = 24) -> list:
    """``first`` runs (``tokens`` greedy tokens), then ``rest`` (4 tokens each) are submitted
    and wait behind it (one row at a time); all the requests, done without an error."""
    on_event, started = after_tokens(1)
    reqs = [engine.submit(EngineRequest(first, greedy(tokens), on_event=on_event))]
    assert started.wait(120)
    reqs += [engine.submit(EngineRequest(p, greedy(4))) for p in rest]
    for req in reqs:
        assert req.done.wait(120) and req.error is None, req.error
    return reqs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava_onevision"])
def test_requests_waiting_behind_a_running_row_are_prepared_ahead_and_keep_their_logits(arch):
    with one_row_engine(arch) as engine:
        prompts = prompts_of(arch)
        logits = record_logits(engine)
        positions = calls_by_thread(engine, "_positions")
        media = calls_by_thread(engine, "_media")
        reqs = behind_a_running_row(engine, prompts[0], prompts[1:])
        for req, prompt in zip(reqs, prompts, strict=True):
            assert_generate_logits(engine, logits, req, prompt, req.params.max_tokens)
        # the requests that waited had their positions made on the prefetch thread, once
        assert positions.get("aphrodite-prefetch", 0) >= len(prompts) - 1, positions
        assert engine.runner.prefetcher.stats["prefetched"] >= len(prompts) - 1
        assert sum(positions.values()) == len(prompts), positions
        if engine.runner.normalizers:  # (Qwen-VL defers normalizing; LLaVA's are floats)
            # (the first request, alone, may be prepared by the prefill itself)
            assert media.get("aphrodite-prefetch", 0) >= len(prompts) - 2 and \
                media.get("aphrodite-engine", 0) <= 1, media
        # the normalized media went once their prefill read them; the positions stay
        assert all(r.inputs.media is None and r.inputs.positions is not None for r in reqs)


def test_a_prefetch_that_raises_is_done_again_by_the_prefill():
    with one_row_engine() as engine:
        prompts = prompts_of("qwen2_5_vl")
        logits = record_logits(engine)
        runner = engine.runner
        own = runner._positions

        def broken(prompt):
            if threading.current_thread().name.startswith("aphrodite-prefetch"):
                raise RuntimeError("prefetch broke")
            return own(prompt)

        runner.prefetcher._positions = broken
        reqs = behind_a_running_row(engine, prompts[0], prompts[1:], tokens=16)
        for req, prompt in zip(reqs, prompts, strict=True):
            assert_generate_logits(engine, logits, req, prompt, req.params.max_tokens)
        assert runner.prefetcher.stats["inline"] >= len(prompts) - 1


def test_no_more_than_ahead_waiting_requests_hold_prepared_inputs(monkeypatch):
    monkeypatch.setattr(prefetch, "AHEAD", 2)
    with one_row_engine() as engine:
        assert engine.runner.prefetcher.ahead == 2
        prompts = prompts_of("qwen2_5_vl")
        held: list[int] = []

        def count() -> None:  # after each step, on the engine thread
            held.append(sum(r.request.inputs is not None for r in engine.waiting))
        engine.on_step.append(count)
        behind_a_running_row(engine, prompts[0],
                             [prompts[1 + i % (len(prompts) - 1)] for i in range(8)])
        assert max(held) == 2, held  # prepared ahead, but two at most


def test_a_request_cancelled_while_waiting_drops_its_prepared_media():
    with one_row_engine() as engine:
        prompts = prompts_of("qwen2_5_vl")
        on_event, started = after_tokens(1)
        running = engine.submit(EngineRequest(prompts[0], greedy(400), on_event=on_event))
        assert started.wait(120)
        waiting = engine.submit(EngineRequest(prompts[1], greedy(4)))  # an image
        while not (isinstance(waiting.inputs, prefetch.Future) and waiting.inputs.done()):
            assert not running.done.is_set()
            time.sleep(0.01)
        assert waiting.inputs.result().media  # its patches normalized, held
        waiting.cancel()
        assert waiting.done.wait(120)
        assert waiting.outputs[0].finish_reason == "abort"
        assert waiting.inputs.result().media is None  # dropped with it, never prefilled
        running.cancel()
        assert running.done.wait(120)
