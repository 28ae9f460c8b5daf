"""bench serve's ramp-up (vLLM's --ramp-up-strategy linear|exponential with
--ramp-up-start-rps/--ramp-up-end-rps): request i of n arrives at the rate the ramp has
reached at i / (n - 1), and vLLM's rules for the flags hold."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from aphrodite_cli.bench.load.client import arrival_times
from aphrodite_cli.bench.load.mock_server import create_app


@pytest.mark.parametrize(("strategy", "rate_at"), [
    ("linear", lambda p: 2 + (50 - 2) * p),
    ("exponential", lambda p: 2 * (50 / 2) ** p),
])
def test_the_ramp_schedule_follows_the_rate_at_each_request(strategy, rate_at):
    """Near-regular arrivals (gamma shape 1000): each gap is 1 / the ramp's rate there."""
    n = 201
    times = arrival_times(n, float("inf"), 1000.0, 3, ramp=(strategy, 2.0, 50.0))
    gaps = np.diff(times)
    want = np.array([1 / rate_at(i / (n - 1)) for i in range(1, n)])
    assert times[0] == 0.0
    assert np.allclose(gaps, want, rtol=0.15)
    assert times == arrival_times(n, float("inf"), 1000.0, 3, ramp=(strategy, 2.0, 50.0))


def test_a_linear_ramp_may_start_at_zero():
    times = arrival_times(5, float("inf"), 1.0, 0, ramp=("linear", 0.0, 10.0))
    assert times[0] == 0.0 and all(np.isfinite(times))


async def _cli(*args: str) -> tuple[int, str]:
    exe = Path(sys.executable).with_name("aphrodite")
    proc = await asyncio.create_subprocess_exec(str(exe), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode()


@pytest.mark.timeout(200)
async def test_bench_serve_ramps_up_as_vllm_does(aiohttp_server, tmp_path):
    server = await aiohttp_server(create_app(0, 0, 1))
    common = ["bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}", "--model",
              "mock", "--num-prompts", "30", "--num-warmups", "0", "--mode", "cold",
              "--items-per-request", "0", "--output-len", "1", "--burstiness", "50",
              "--out-dir", str(tmp_path), "--result-filename", "ramp.json"]
    code, said = await _cli(*common, "--ramp-up-strategy", "linear", "--ramp-up-start-rps",
                            "2", "--ramp-up-end-rps", "60")
    assert code == 0, said
    doc = json.loads((tmp_path / "ramp.json").read_text())
    assert (doc["ramp_up_strategy"], doc["ramp_up_start_rps"], doc["ramp_up_end_rps"]) == (
        "linear", 2.0, 60.0)
    sent = sorted(r["sent_ms"] for r in doc["requests"]["cold"])
    first, last = np.diff(sent[:6]).mean(), np.diff(sent[-6:]).mean()
    assert first > 4 * last, sent  # sent at about 4/s at first, about 55/s at the end
    for bad, words in ((["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"],
                        "needs both"),
                       (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0",
                         "--ramp-up-end-rps", "5"], "cannot start at 0"),
                       (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "9",
                         "--ramp-up-end-rps", "5"], "the start at most the end"),
                       (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1",
                         "--ramp-up-end-rps", "5", "--request-rate", "3"], "--request-rate"),
                       (["--ramp-up-start-rps", "1"], "need --ramp-up-strategy")):
        code, said = await _cli(*common, *bad)
        assert code == 2 and words in said, (bad, said)
