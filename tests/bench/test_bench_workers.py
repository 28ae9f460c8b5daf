"""``bench serve --num-workers``: client processes sharing one schedule send the same requests at
the same times as one process, hold --max-concurrency across all of them, and give the same
metrics (against a mock with a fixed TTFT and ITL). No throughput is asserted here: the
scaling is measured by scripts/client_scaling.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from aiohttp import web

from aphrodite_cli.bench.data.datasets import parse_buckets, random_mm
from aphrodite_cli.bench.load.client import (
    ArrivalConfig,
    LoadConfig,
    TargetConfig,
    TargetRefused,
    build_payload,
    schedule,
)
from aphrodite_cli.bench.load.metrics import compute
from aphrodite_cli.bench.load.mock_server import create_app
from aphrodite_cli.bench.load.workers import run_phase

TTFT_MS, ITL_MS, TOKENS = 40.0, 5.0, 6


async def _run(base: str, workers: int, n: int, **arrivals) -> tuple[list, dict, LoadConfig]:
    cfg = LoadConfig(target=TargetConfig(base_url=base),
                     arrivals=ArrivalConfig(num_workers=workers, **arrivals), seed=3)
    reqs = random_mm(n, items=0, buckets=parse_buckets(None), prompt_len=4,
                     output_len=TOKENS, seed=3, nonce=1)
    records, duration, _ = await run_phase([build_payload(r, cfg, None, {}) for r in reqs],
                                           cfg)
    return records, compute(records, duration), cfg


async def test_two_workers_send_the_same_schedule_and_measure_the_same(aiohttp_server):
    server = await aiohttp_server(create_app(TTFT_MS, ITL_MS, None))
    base = f"http://127.0.0.1:{server.port}"
    runs = {}
    for workers in (1, 2):
        # every request leaves at its arrival time (offsets from the first send; the loaded
        # test machine may be late by a few ms, never early). The run lasts 0.8 s: a stall
        # of the machine (CI's other shard loading a model on both cores) once made every
        # later send of a run 0.7 s late, so a run may be taken again, twice at most; a
        # sender off its schedule is off it every time.
        for attempt in range(3):
            records, result, cfg = await _run(base, workers, 24, request_rate=30.0)
            times = np.array(schedule(24, cfg))
            assert result["completed"] == 24 and result["failed"] == 0, (workers, result)
            assert [r.index for r in records] == list(range(24))
            sent = np.array([r.sent_at for r in records])
            late = (sent - sent[0]) - (times - times[0])
            if np.abs(late).max() < 0.05 or attempt == 2:
                break
        assert np.abs(late).max() < 0.05, (workers, late)
        assert result["total_output_tokens"] == 24 * TOKENS
        runs[workers] = (records, result, cfg)
    one, two = runs[1][1], runs[2][1]
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert abs(one[metric]["median"] - two[metric]["median"]) < 15, (metric, one, two)
    assert abs(two["ttft_ms"]["median"] - TTFT_MS) < 20
    assert abs(two["tpot_ms"]["median"] - ITL_MS) < 4


async def test_max_concurrency_is_held_across_workers_in_arrival_order(aiohttp_server):
    """All at once with --max-concurrency 3 over 3 workers: never more than 3 in flight in
    all, 3 at once in steady state, and slots granted in request order as one process's
    semaphore grants them."""
    server = await aiohttp_server(create_app(TTFT_MS, ITL_MS, None))
    base = f"http://127.0.0.1:{server.port}"
    records, result, _ = await _run(base, 3, 12, max_concurrency=3)
    assert result["completed"] == 12
    events = sorted([(r.sent_at, 1) for r in records] + [(r.sent_at + r.e2e, -1)
                                                         for r in records])
    in_flight = np.cumsum([step for _, step in events])
    assert in_flight.max() == 3
    # granted in request order: the k-th round of sends is requests 3k..3k+2 (within a
    # round the workers race to the socket), each sent after a request of the round before
    # ended
    order = sorted(range(12), key=lambda i: records[i].sent_at)
    assert [set(order[k:k + 3]) for k in range(0, 12, 3)] == [
        {k, k + 1, k + 2} for k in range(0, 12, 3)]
    for i in range(3, 12):
        assert records[i].sent_at >= min(r.sent_at + r.e2e for r in records[:3])
    # each of the 4 rounds of 3 waits for the round before: the phase is ~4 answers long
    span = max(r.sent_at + r.e2e for r in records) - min(r.sent_at for r in records)
    one_answer = (TTFT_MS + ITL_MS * (TOKENS - 1)) / 1000
    assert 4 * one_answer <= span < 4 * one_answer + 0.4, span


async def test_a_worker_held_back_keeps_only_its_own_slots(aiohttp_server):
    """A worker that gets no CPU for a second (stopped, as a worker on a busy core is slowed)
    holds only the slots it had: the other worker's slots keep cycling, so requests still
    end during the pause. Dealing requests out in turn gave every slot to the held worker
    one by one and nothing ended until it ran again."""

    app, answered = create_app(20.0, 2.0, None), []

    async def count(request, response) -> None:
        answered.append(request.path)

    app.on_response_prepare.append(count)
    server = await aiohttp_server(app)
    base = f"http://127.0.0.1:{server.port}"
    phase = asyncio.ensure_future(_run(base, 2, 400, max_concurrency=4))
    held = None
    try:
        while len(answered) < 20 and not phase.done():  # the phase under way
            await asyncio.sleep(0.01)
        held = next(p for p in multiprocessing.active_children()
                    if p.name == "bench-client-0")
        os.kill(held.pid, signal.SIGSTOP)
        paused = time.perf_counter()
        await asyncio.sleep(1.0)
        resumed = time.perf_counter()
    finally:
        if held is not None:
            os.kill(held.pid, signal.SIGCONT)
    records, result, _ = await phase
    assert result["completed"] == 400, result
    ended = [r.sent_at + r.e2e for r in records if r.e2e is not None]
    during = sum(paused + 0.2 < t < resumed for t in ended)
    # two free-running slots end an answer about every 15 ms: ~50 in the 0.8 s watched
    assert during >= 10, during


async def test_a_target_that_refuses_everything_stops_the_workers(aiohttp_server):
    """The same 401 for the first answers (a wrong key): the phase stops with the first
    --abort-after-failures records, the rest are never sent, and the workers exit."""

    seen = []

    async def refuse(request):
        seen.append(1)
        return web.json_response({"error": {"message": "bad key"}}, status=401)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    server = await aiohttp_server(app)
    with pytest.raises(TargetRefused) as refused:
        await _run(f"http://127.0.0.1:{server.port}", 2, 2000, max_concurrency=2)
    assert [r.status for r in refused.value.records] == [401] * 5
    assert len(seen) < 20, len(seen)  # at most the slots' worth after the fifth answer
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bench-client")]


def test_the_command_runs_its_workers_and_records_them(tmp_path):
    """``bench serve --num-workers 2`` against the mock server (its own process): every
    request answered, the setting in the result's config; with sessions, a one-line error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.server_harness import free_port, wait_exit

    exe = Path(sys.executable).with_name("aphrodite")
    port = free_port()
    mock = subprocess.Popen([str(exe), "bench", "mock-server", "--port", str(port),
                             "--ttft-ms", "5"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    args = [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", "random", "--num-prompts", "20", "--num-warmups", "1",
            "--mode", "cold", "--output-len", "3", "--max-concurrency", "4",
            "--num-workers", "2", "--no-server-cpu", "--no-reset-caches",
            "--out-dir", str(tmp_path), "--result-filename", "w.json"]
    env = {**os.environ, "COLUMNS": "200"}
    try:
        mock.stdout.readline()
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        refused = subprocess.run([*args, "--conversation-num", "2"], capture_output=True,
                                 text=True, timeout=60, env=env)
    finally:
        mock.terminate()
        wait_exit(mock, 30)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["config"]["num_workers"] == 2 and doc["phases"]["cold"]["completed"] == 20
    assert refused.returncode == 2 and "--num-workers splits one schedule" in refused.stderr
    assert "Traceback" not in refused.stderr
