"""Prefills beside decode steps (``--overlap-prefill``), on real tiny models: the running rows
keep stepping while the rows that join are prefilled on the prefill thread, every row still
gets exactly its greedy tokens and ``generate``'s logits, a prefill that raises fails only its
request, and a cache reset or a cancel that comes meanwhile waits for the prefill's end."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from engine.config import MIN_OVERLAP_PARAMETERS, EngineConfig
from engine.errors import AphroditeError, ConfigError
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from tests.engine.test_scheduler import (
    after_tokens,
    assert_generate_logits,
    greedy,
    prompts_of,
    record_logits,
    run_alone,
)
from tests.engine_fixtures import llm

OVERLAP = EngineConfig(max_num_seqs=8, overlap_prefill=True)


class HeldPrefill:
    """Wraps the runner's prefill: each prefill on the prefill thread waits there until the
    watched request streamed ``more`` tokens (which only decode steps running beside it can
    give) or ``go`` is set, and records which."""

    def __init__(self, engine: Engine, more: int) -> None:
        self.engine, self.more = engine, more
        self.watched: list[int] | None = None
        self.saw_decode_meanwhile: list[bool] = []
        self.started = threading.Event()
        self.go = threading.Event()
        self._prefill = engine.runner.prefill
        engine.runner.prefill = self

    def __call__(self, rows):
        if self.watched is not None and threading.current_thread().name.startswith(
                "aphrodite-prefill"):
            self.started.set()
            before = len(self.watched)
            deadline = time.monotonic() + 120
            while len(self.watched) < before + self.more and not self.go.is_set() and \
                    time.monotonic() < deadline:
                time.sleep(0.002)
            self.saw_decode_meanwhile.append(len(self.watched) >= before + self.more)
        return self._prefill(rows)

    def token_counter(self):
        tokens: list[int] = []
        self.watched = tokens

        def on_event(event) -> None:
            if event.token_id is not None:
                tokens.append(event.token_id)
        return on_event


def join_beside(engine: Engine, held: HeldPrefill, prompts: list, lengths: list[int]
                ) -> list[EngineRequest]:
    """The first prompt runs; once the second's first token is out (so rows are running)
    the rest join, prefilled beside its decode steps. Every request, done and without error."""
    long = engine.submit(EngineRequest(prompts[0], greedy(lengths[0]),
                                       on_event=held.token_counter()))
    first, started = after_tokens(1)
    joined = [engine.submit(EngineRequest(prompts[1], greedy(lengths[1]), on_event=first))]
    assert started.wait(120)
    joined += [engine.submit(EngineRequest(p, greedy(n)))
               for p, n in zip(prompts[2:], lengths[2:], strict=True)]
    for req in (long, *joined):
        assert req.done.wait(120) and req.error is None, req.error
    return [long, *joined]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava_onevision"])
def test_rows_prefilled_beside_decode_steps_get_their_solo_tokens_and_logits(arch):
    model = llm(arch)
    engine = Engine(model.loaded, OVERLAP)
    try:
        prompts = prompts_of(arch)
        lengths = [48] + [3 + 4 * i for i in range(1, len(prompts))]
        solo = [run_alone(engine, p, greedy(n)) for p, n in zip(prompts, lengths, strict=True)]
        logits = record_logits(engine)
        held = HeldPrefill(engine, more=3)
        requests = join_beside(engine, held, prompts, lengths)
        assert [r.outputs[0].token_ids for r in requests] == solo
        for req, prompt, n in zip(requests, prompts, lengths, strict=True):
            assert_generate_logits(engine, logits, req, prompt, n)
        # the joins ran on the prefill thread, and the long row took steps while they did
        assert engine.stats["prefills_overlapped_total"] >= 1
        assert held.saw_decode_meanwhile and all(held.saw_decode_meanwhile)
    finally:
        engine.close()


def test_an_overlapped_prefill_that_raises_fails_only_its_request():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, OVERLAP, batch_wait_s=0.5)
    try:
        prompts = prompts_of("qwen2_5_vl")
        good = prompts[1]  # one image
        pixels = good.mm["pixel_values"]
        # half its patches gone: the vision tower's output no longer fits the placeholders
        bad = dataclasses.replace(good, mm={**good.mm, "pixel_values": pixels[:len(pixels) // 2]},
                                  mm_hashes=["poisoned"])
        solo_long, solo_good = run_alone(engine, prompts[0], greedy(40)), \
            run_alone(engine, good, greedy(6))
        on_event, started = after_tokens(2)
        long = engine.submit(EngineRequest(prompts[0], greedy(40), on_event=on_event))
        assert started.wait(120)
        before = engine.stats["prefills_overlapped_total"]
        pair = [engine.submit(EngineRequest(p, greedy(6))) for p in (bad, good)]
        for req in (long, *pair):
            assert req.done.wait(120)
        assert isinstance(pair[0].error, AphroditeError)
        assert pair[1].error is None and pair[1].outputs[0].token_ids == solo_good
        assert long.error is None and long.outputs[0].token_ids == solo_long
        assert engine.stats["prefills_overlapped_total"] > before
        assert run_alone(engine, good, greedy(2))  # still serving
    finally:
        engine.close()


def test_a_reset_or_a_cancel_during_an_overlapped_prefill_waits_for_its_end():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, OVERLAP)
    try:
        prompts = prompts_of("qwen2_5_vl")
        held = HeldPrefill(engine, more=10 ** 6)  # held until released below
        on_event = held.token_counter()
        long = engine.submit(EngineRequest(prompts[0], greedy(400), on_event=on_event))
        while not held.watched:  # running (its own prefill was on the engine thread)
            time.sleep(0.01)
        joining = engine.submit(EngineRequest(prompts[1], greedy(400)))
        assert held.started.wait(120)  # a prefill is on the prefill thread, held
        answer: dict = {}
        resetter = threading.Thread(target=lambda: answer.update(engine.reset_prefix_cache()))
        resetter.start()
        resetter.join(1.0)
        assert resetter.is_alive()  # the reset waits: the prefill may be filling the cache
        joining.cancel()
        held.go.set()
        resetter.join(120)
        assert answer.get("reset") is True, answer
        assert joining.done.wait(120) and joining.outputs[0].finish_reason == "abort"
        long.cancel()
        assert long.done.wait(120) and long.outputs[0].finish_reason == "abort"
        assert engine.scheduler_stats()["num_rows_running"] == 0
        assert run_alone(engine, prompts[1], greedy(2))
    finally:
        engine.close()


def test_a_request_failing_while_one_of_its_rows_is_prefilled_beside_ends_that_row_too():
    """n=3 split by --max-num-seqs: two rows run, the third is prefilled on the prefill
    thread when a decode step fails for the request. The request fails at once and the row
    in flight ends when it joins, without a token (it ran to max_tokens, 300 tokens of a
    request already failed, before its error was sent)."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=3, overlap_prefill=True))
    runner = engine.runner
    go, held, failing = threading.Event(), threading.Event(), {}
    prefill, decode = runner.prefill, runner.decode

    def held_prefill(rows):
        if threading.current_thread().name.startswith("aphrodite-prefill") and \
                any(r.index == 2 for r in rows):
            held.set()
            go.wait(120)
        return prefill(rows)

    def failing_decode(batch):
        if "req" in failing and any(r.request is failing["req"] for r in batch.rows):
            raise RuntimeError("a decode step failing for this request")
        return decode(batch)

    runner.prefill, runner.decode = held_prefill, failing_decode
    try:
        prompt = prompts_of("qwen2_5_vl")[0]
        first = engine.submit(EngineRequest(prompt, greedy(4096)))
        indexes: list[int] = []
        split = engine.submit(EngineRequest(
            prompt, SamplingParams(n=3, max_tokens=300, temperature=0, ignore_eos=True),
            on_event=lambda e: indexes.append(e.index)))
        deadline = time.monotonic() + 120
        while len(set(indexes)) < 2 and time.monotonic() < deadline:  # rows 0 and 1 run
            time.sleep(0.01)
        first.cancel()  # a place for row 2, prefilled beside rows 0 and 1
        assert held.wait(120)
        failing["req"] = split
        while split.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert split.error is not None
        tokens_at_failure = len(indexes)
        go.set()
        assert split.done.wait(120)
        assert len(indexes) == tokens_at_failure and split.outputs[2].token_ids == []
        assert engine.scheduler_stats()["num_rows_running"] == 0
    finally:
        go.set()
        runner.prefill, runner.decode = prefill, decode
        engine.close()


def test_overlap_is_on_where_a_core_is_left_for_it_and_the_model_is_big_enough():
    big = MIN_OVERLAP_PARAMETERS
    assert EngineConfig(num_threads=1).overlaps_prefill(2, big)
    assert not EngineConfig(num_threads=1).overlaps_prefill(2, big - 1)  # mostly Python
    assert not EngineConfig().overlaps_prefill(2, big)  # torch's threads fill both cores
    assert not EngineConfig().overlaps_prefill(1, big)
    assert EngineConfig(num_threads=4).overlaps_prefill(16, big)
    assert not EngineConfig(num_threads=1, device="cuda").overlaps_prefill(16, big)
    assert EngineConfig(overlap_prefill=True).overlaps_prefill(1, 1)
    assert not EngineConfig(num_threads=1, overlap_prefill=False).overlaps_prefill(8, big)
    with pytest.raises(ConfigError, match="--overlap-prefill"):
        EngineConfig(overlap_prefill="yes")  # type: ignore[arg-type]
