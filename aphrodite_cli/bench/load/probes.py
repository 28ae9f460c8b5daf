"""``--probe-request-rate R``: small text-only requests sent at R per second (Poisson) while a
measured phase runs, and measured apart from it.

A probe carries no media and asks for a few tokens, so its latency is what any small request
waits while the phase's large media are fetched, decoded and prefilled: how much the media
stall other traffic (head-of-line blocking), read from the probes' TTFT and E2E against the
same server idle (or against another server under the same load). Probes never count in the
phase's own metrics; they stop being sent when the phase's last request has finished, and
the ones in flight are waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import numpy as np

from aphrodite_cli.bench.load.client import LoadConfig, one_request, server_root
from aphrodite_cli.bench.load.metrics import RequestRecord, compute
from aphrodite_cli.bench.load.wire import request_headers

#: A probe's prompt and answer length: small, so its own cost is negligible.
PROMPT = "Reply with one word: ok"
OUTPUT_LEN = 4


def probe_body(cfg: LoadConfig, output_len: int = OUTPUT_LEN) -> bytes:
    """A text-only request for ``cfg``'s endpoint (chat or completions)."""
    body: dict[str, Any] = {"max_tokens": output_len, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos}
    if cfg.target.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if cfg.target.model:
        body["model"] = cfg.target.model
    body.update(cfg.target.extra_body)  # --extra-body, as on the phase's own requests
    return json.dumps(body).encode()


class Probes:
    """``async with Probes(cfg, rate):`` around a phase; :attr:`records` after it."""

    def __init__(self, cfg: LoadConfig, rate: float, seed: int = 0) -> None:
        self.cfg, self.rate, self.seed = cfg, rate, seed
        self.records: list[RequestRecord] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started = 0.0
        self.duration = 0.0

    async def _run(self) -> None:
        cfg = self.cfg
        url = server_root(cfg.target.base_url) + cfg.target.endpoint
        headers = request_headers(cfg.target.api_key, cfg.target.headers)
        body = probe_body(cfg)
        rng = np.random.default_rng(self.seed + 104729)
        inflight: list[asyncio.Task] = []
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as session:
            while not self._stop.is_set():
                record = RequestRecord(len(self.records))
                self.records.append(record)
                inflight.append(asyncio.create_task(
                    one_request(session, url, headers, body, record, cfg)))
                gap = float(rng.exponential(1.0 / self.rate))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), gap)
            await asyncio.gather(*inflight, return_exceptions=True)

    async def __aenter__(self) -> Probes:
        self._started = time.perf_counter()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        self.duration = time.perf_counter() - self._started

    def result(self) -> dict[str, Any]:
        """The probes' own metrics (the same formulas as the phase's) and samples."""
        metrics = compute(self.records, self.duration)
        done = [r for r in self.records if r.ok]
        return {"request_rate": self.rate, "sent": len(self.records),
                "completed": metrics["completed"], "failed": metrics["failed"],
                "failures_by_type": metrics["failures_by_type"],
                "prompt": PROMPT, "output_len": OUTPUT_LEN,
                "ttft_ms": metrics["ttft_ms"], "e2e_ms": metrics["e2e_ms"],
                "tpot_ms": metrics["tpot_ms"],
                "samples": {"ttft_ms": [r.ttft * 1e3 for r in done if r.ttft is not None],
                            "e2e_ms": [r.e2e * 1e3 for r in done if r.e2e is not None]}}
