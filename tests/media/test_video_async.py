"""Decoding off the event loop, several videos in parallel, GPU decodes under the budget.

The oracles spy on ``decode_planned``, the function ``load_video_async`` runs on the decode
pool (patched on the loader module, wrapping the real one), so they see what is decoding, on
which thread and with what reserved, rather than inferring it from timings.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config import MediaLimits
from engine.media import pool as pool_module
from engine.media.pool import decode_executor
from engine.media.video import load_video_async, loader
from engine.media.video.budget import GpuDecodeBudget
from engine.media.video.options import server_video_spec
from tests.fixtures import synthetic

# How long a decode waits for its partner, or for a condition, before the test gives up.
# Generous: a verdict never depends on it on a slow, loaded 2-core machine; it only bounds how
# long a broken build takes to fail (a passing run never waits this long).
DEADLINE_S = 30.0


@pytest.fixture
def fresh_decode_pool(monkeypatch):
    """A new 4-thread decode pool for this test. The pool is process-wide and sized once, on
    first use, from APHRODITE_MEDIA_LOADING_THREAD_COUNT: an earlier test may have built it
    with another size, and these tests need at least 2 threads. The variable is set only while
    the pool is built (the deepstream backend sizes its own process-wide pool from it too)."""
    monkeypatch.setattr(pool_module, "_pool", None)
    with monkeypatch.context() as scoped:
        scoped.setenv("APHRODITE_MEDIA_LOADING_THREAD_COUNT", "4")
        executor = decode_executor()
    assert executor._max_workers == 4
    yield executor
    executor.shutdown(wait=True)  # monkeypatch then puts the previous pool back


def spy_on_decodes(monkeypatch, enter, leave=None):
    """Make the loader run ``enter(args)`` in the decoding thread, then the real decode, then
    ``leave()`` (even when the decode fails)."""
    real = loader.decode_planned

    def spy(*args, **kwargs):
        try:
            enter(args)
            return real(*args, **kwargs)
        finally:
            if leave is not None:
                leave()

    monkeypatch.setattr(loader, "decode_planned", spy)


async def test_videos_decode_in_parallel_off_the_loop(fresh_decode_pool, monkeypatch):
    """Two decodes must be inside the decoder at the same time (a barrier of two: decoding one
    after the other breaks it), on pool threads, while the event loop keeps running tasks (the
    decodes wait for a task on the loop to answer: a blocked loop never would)."""
    clips = [synthetic.make_video(width=96, height=64, seconds=1, seed=s) for s in range(2)]
    spec = server_video_spec({"video": {"backend": "pyav", "num_frames": 4}})
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    together = threading.Barrier(2, timeout=DEADLINE_S)
    both_inside = asyncio.Event()
    loop_answered = threading.Event()
    threads: list[tuple[int, str]] = []

    def inside(_args) -> None:
        threads.append((threading.get_ident(), threading.current_thread().name))
        together.wait()  # BrokenBarrierError unless the other decode is inside too
        loop.call_soon_threadsafe(both_inside.set)
        if not loop_answered.wait(DEADLINE_S):
            raise AssertionError("the event loop did not run while videos were decoding")

    async def answer() -> None:
        await both_inside.wait()
        loop_answered.set()

    spy_on_decodes(monkeypatch, inside)
    responder = asyncio.create_task(answer())
    try:
        results = await asyncio.gather(*(load_video_async(c, spec, MediaLimits.from_env())
                                         for c in clips))
    finally:
        responder.cancel()
    assert loop_answered.is_set()
    assert [r.frames.shape for r in results] == [(4, 64, 96, 3)] * 2
    assert len(threads) == 2 and len({ident for ident, _ in threads}) == 2
    assert all(ident != loop_thread and name.startswith("aphrodite-decode")
               for ident, name in threads)


async def test_gpu_backend_holds_the_budget_while_decoding(fresh_decode_pool, monkeypatch):
    """Every GPU decode runs with exactly its frames' bytes reserved, and with a budget of
    exactly one decode's frames no two decodes overlap.

    Overlap is made certain when the budget is not enforced: the first decode to start holds
    until each of the three requests is either decoding or queued on the budget (a
    condition, polled, not a sleep). With the budget, the other two are queued and the first
    goes on alone; without it, all three are decoding at once."""
    clip = synthetic.make_video(width=64, height=48, seconds=0.5)
    spec = server_video_spec({"video": {"backend": "deepstream", "num_frames": 4}})
    need = 64 * 48 * 3 * 4
    budget = GpuDecodeBudget(need)  # exactly one decode's frames
    lock = threading.Lock()
    count = {"started": 0, "running": 0, "most_running": 0}
    reserved: list[tuple[int, int]] = []  # (budget.in_use, its own frames' bytes) per decode

    def enter(args) -> None:
        _data, _spec, scan, indices, *_ = args
        with lock:
            count["started"] += 1
            count["running"] += 1
            count["most_running"] = max(count["most_running"], count["running"])
            reserved.append((budget.in_use, loader.decoded_bytes(scan, indices)))
        deadline = time.monotonic() + DEADLINE_S
        while count["started"] + budget.waiting < 3:
            if time.monotonic() > deadline:
                raise AssertionError("the other requests neither decoded nor queued")
            time.sleep(0.001)

    def leave() -> None:
        with lock:
            count["running"] -= 1

    spy_on_decodes(monkeypatch, enter, leave)
    results = await asyncio.gather(*(load_video_async(clip, spec, MediaLimits.from_env(),
                                                      budget) for _ in range(3)))
    assert all(r.frames.shape == (4, 48, 64, 3) for r in results)
    assert reserved == [(need, need)] * 3, reserved
    assert count["started"] == 3 and count["most_running"] == 1, count
    assert budget.in_use == 0 and budget.waiting == 0
