"""``--decode-threads`` (llama.cpp's ``--threads`` beside ``--threads-batch``): the engine's
decode steps run on their own torch thread count, its prefills and encoders on
``--num-threads``, on a real tiny model; outputs stay those of the model's own ``generate``.
Each thread keeps its own count, so a prefill beside the decode steps (``--overlap-prefill``)
runs on ``--num-threads`` while the steps run on theirs; bad values are refused."""

from __future__ import annotations

import threading

import pytest

from engine.config import MIN_OVERLAP_PARAMETERS, EngineConfig
from engine.cpus import use_torch_threads
from engine.errors import ConfigError
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from tests.engine.test_overlap_prefill import HeldPrefill, join_beside
from tests.engine.test_scheduler import assert_generate_logits, greedy, prompts_of, record_logits
from tests.engine_fixtures import llm


def watch_threads(engine: Engine) -> dict[str, set]:
    """The torch thread counts each of the runner's prefills and decode steps ran with, and
    (under ``"where"``) which thread ran each with which count."""
    import torch

    seen: dict[str, set] = {"prefill": set(), "decode": set(), "where": set()}
    runner = engine.runner
    prefill, decode = runner.prefill, runner.decode

    def record(kind: str) -> None:
        count = torch.get_num_threads()
        seen[kind].add(count)
        seen["where"].add((kind, threading.current_thread().name.split("_")[0], count))

    def watched_prefill(rows):
        record("prefill")
        return prefill(rows)

    def watched_decode(batch):
        record("decode")
        return decode(batch)

    runner.prefill, runner.decode = watched_prefill, watched_decode
    return seen


def test_decode_steps_run_on_decode_threads_and_prefills_on_num_threads():
    import torch

    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=4, num_threads=2,
                                               decode_threads=1))
    try:
        assert engine._prefiller is None  # 2 + 1 threads would not fit 2 CPUs: no overlap
        seen = watch_threads(engine)
        logits = record_logits(engine)
        prompts = prompts_of("qwen2_5_vl")
        lengths = [12 + 3 * i for i in range(len(prompts))]
        requests = [engine.submit(EngineRequest(p, greedy(n)))
                    for p, n in zip(prompts, lengths, strict=True)]
        for req in requests:
            assert req.done.wait(120) and req.error is None, req.error
        assert (seen["prefill"], seen["decode"]) == ({2}, {1})
        # a prefill after decode steps runs on --num-threads again (the count is put back)
        seen["prefill"].clear()
        later = engine.submit(EngineRequest(prompts[0], greedy(3)))
        assert later.done.wait(120) and later.error is None, later.error
        assert seen["prefill"] == {2}
        assert torch.get_num_threads() == 2  # the caller's own count: Engine() set it
        for req, prompt, n in zip(requests, prompts, lengths, strict=True):
            assert len(req.outputs[0].token_ids) == n
            assert_generate_logits(engine, logits, req, prompt, n)
    finally:
        engine.close()


def test_a_prefill_beside_the_decode_steps_keeps_its_own_thread_count():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8, num_threads=2, decode_threads=1,
                                               overlap_prefill=True))
    try:
        seen = watch_threads(engine)
        logits = record_logits(engine)
        held = HeldPrefill(engine, more=3)  # the joins wait on the prefill thread for steps
        prompts = prompts_of("qwen2_5_vl")
        lengths = [40] + [4 + 3 * i for i in range(1, len(prompts))]
        requests = join_beside(engine, held, prompts, lengths)
        assert engine.stats["prefills_overlapped_total"] >= 1
        assert held.saw_decode_meanwhile and all(held.saw_decode_meanwhile)
        # the joins ran on the prefill thread on 2 threads, after decode steps on 1 had run
        # beside them on the engine thread
        assert ("prefill", "aphrodite-prefill", 2) in seen["where"]
        assert (seen["prefill"], seen["decode"]) == ({2}, {1})
        for req, prompt, n in zip(requests, prompts, lengths, strict=True):
            assert_generate_logits(engine, logits, req, prompt, n)
    finally:
        engine.close()


def test_each_thread_keeps_the_torch_thread_count_it_set():
    """One thread sets 1, then another sets 2 (torch's "last set" count): the first keeps 1
    through its later operations, the second keeps 2."""
    import torch

    first_set, second_set = threading.Event(), threading.Event()
    counts: dict[str, list[int]] = {}

    def work(name: str, count: int, before: threading.Event | None,
             after: threading.Event) -> None:
        if before is not None:
            assert before.wait(30)
        use_torch_threads(count)
        after.set()
        assert second_set.wait(30)
        x = torch.ones(256, 256)
        _ = (x @ x).sum(dim=1)
        counts[name] = [torch.get_num_threads()]
        _ = torch.softmax(x, dim=-1)
        counts[name].append(torch.get_num_threads())

    threads = [threading.Thread(target=work, args=("first", 1, None, first_set)),
               threading.Thread(target=work, args=("second", 2, first_set, second_set))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert counts == {"first": [1, 1], "second": [2, 2]}


def test_without_decode_threads_every_step_runs_on_num_threads():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=4, num_threads=2))
    try:
        seen = watch_threads(engine)
        req = engine.submit(EngineRequest(prompts_of("qwen2_5_vl")[0], greedy(5)))
        assert req.done.wait(120) and req.error is None, req.error
        assert (seen["prefill"], seen["decode"]) == ({2}, {2})
    finally:
        engine.close()


def test_the_overlap_default_counts_the_prefill_and_the_decode_threads_together():
    big = MIN_OVERLAP_PARAMETERS
    assert EngineConfig(num_threads=1).overlaps_prefill(2, big)
    assert EngineConfig(num_threads=1, decode_threads=1).overlaps_prefill(2, big)
    assert not EngineConfig(num_threads=2, decode_threads=1).overlaps_prefill(2, big)  # 3 > 2
    assert not EngineConfig(decode_threads=1).overlaps_prefill(2, big)  # 2 + 1 > 2
    assert EngineConfig(num_threads=6, decode_threads=2).overlaps_prefill(8, big)
    assert not EngineConfig(num_threads=4).overlaps_prefill(6, big)  # 4 + 4 > 6
    assert not EngineConfig(decode_threads=1, overlap_prefill=False).overlaps_prefill(8, big)
    assert EngineConfig(decode_threads=1, overlap_prefill=True).overlaps_prefill(2, big)
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ConfigError, match="--decode-threads must be a whole number"):
            EngineConfig(decode_threads=bad)  # type: ignore[arg-type]


def _tasks() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> int:
    """A product torch runs on 2 OpenMP threads (starting the calling thread's workers)."""
    import torch

    use_torch_threads(2)
    x = torch.ones(512, 512)
    for _ in range(3):
        x = torch.tanh(x @ x / 512)
    return torch.get_num_threads()


def _settled(want: int, timeout_s: float = 5.0) -> int:
    import time

    deadline = time.monotonic() + timeout_s
    while _tasks() != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return _tasks()


def test_in_own_thread_returns_raises_and_its_openmp_workers_end_with_it():
    """libgomp keeps a pool of workers per thread that ran a parallel region, for that thread's
    life; more pooled threads than CPUs make every pool's workers sleep between regions (a
    2-thread decode step 1.2-1.3x slower). What runs through in_own_thread leaves no workers;
    the same work on a thread that lives on leaves its own (so the count can tell)."""
    from engine.cpus import in_own_thread

    assert in_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ConfigError, match="named rule"):
        in_own_thread(lambda: (_ for _ in ()).throw(ConfigError("named rule")))
    # called from a fresh thread (this one may have workers from earlier tests), which lives
    # on while the workers are counted: with the work run on the caller, its workers would
    # stay
    seen: dict[str, int] = {}

    def caller() -> None:
        seen["before"] = _tasks()
        seen["threads"] = in_own_thread(_parallel_work)
        seen["after"] = _settled(seen["before"])

    _on_a_fresh_thread(caller)
    assert seen["threads"] == 2 and seen["after"] == seen["before"]

    def stays() -> None:
        seen["before"] = _tasks()
        _parallel_work()
        seen["after"] = _tasks()

    _on_a_fresh_thread(stays)
    assert seen["after"] > seen["before"]  # the thread's own workers


def _on_a_fresh_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()


def test_the_prefetch_thread_runs_one_torch_thread():
    """Media preparation ahead of the prefills runs beside the decode steps on one torch
    thread: it starts no OpenMP workers of its own."""
    import torch

    pool = llm("qwen2_5_vl").engine.runner.prefetcher._pool
    assert pool.submit(torch.get_num_threads).result(30) == 1
