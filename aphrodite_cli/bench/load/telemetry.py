"""The target's state over a phase (``--metrics-interval SECONDS``): its ``/metrics`` scraped
every interval while the phase runs (and once at its start and end), and this machine's GPUs
read through NVML (:mod:`~aphrodite_cli.bench.load.gpu_telemetry`) at the same ticks.

A phase's ``telemetry``::

    {"interval_s": 1.0,
     "metrics": {"available": true, "failed_scrapes": 0,
                 "series": {"num_requests_running": "vllm:num_requests_running", ...},
                 "samples": [{"t_s": 0.0, "num_requests_running": 0.0, ...}, ...]},
     "gpu": {"available": false, "reason": "NVML could not start (...)"}}

``t_s`` is seconds since the phase started, when the answer arrived; samples are in time
order. Each series is the first of its Prometheus names the target exports (vLLM's, which
this project's server exports too, then this project's own), summed over label sets (vLLM
labels each engine), ``*_perc`` gauges averaged. Counters (``prefix_cache_hits``,
``prompt_tokens``...) are the server's running totals: the report draws their rate. A series
the target does not export is absent; a target without ``/metrics`` gives ``available:
false`` and the scrapes' reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from aphrodite_cli.bench.load import scrape
from aphrodite_cli.bench.load.gpu_telemetry import GpuSampler
from aphrodite_cli.bench.results.fields import SERIES

#: the most samples a phase keeps (a long phase at a short interval stops adding)
MAX_SAMPLES = 100_000


def select(samples: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """The series' values in one scrape, and the Prometheus name each came from."""
    by_name: dict[str, list[float]] = {}
    for key, value in samples.items():
        if not math.isfinite(value):  # NaN: the server does not know it now
            continue
        by_name.setdefault(key.split("{", 1)[0], []).append(value)
    values, names = {}, {}
    for series, candidates in SERIES.items():
        name = next((n for n in candidates if n in by_name), None)
        if name is not None:
            found = by_name[name]
            values[series] = sum(found) / len(found) if name.endswith("_perc") else sum(found)
            names[series] = name
    return values, names


class Telemetry:
    """``await start()`` as the phase starts, ``await stop()`` after it; then ``result()``."""

    def __init__(self, root: str, interval_s: float, *, api_key: str | None = None,
                 headers: dict[str, str] | None = None, gpu: GpuSampler | None = None
                 ) -> None:
        self.root, self.interval_s = root, interval_s
        self.api_key, self.headers = api_key, headers
        self.gpu = gpu if gpu is not None else GpuSampler()
        self.gpu_reason: str | None = None
        self.samples: list[dict[str, Any]] = []
        self.gpu_samples: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}
        self.failures: list[str] = []
        self._start = 0.0
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        if len(self.samples) + len(self.failures) >= MAX_SAMPLES:
            return
        got = await scrape.scrape(self.root, self.api_key, timeout_s=max(self.interval_s, 1.0),
                                  extra_headers=self.headers, gauges=True)
        t_s = round(time.perf_counter() - self._start, 4)
        if isinstance(got, str):
            self.failures.append(got)
        else:
            values, names = select(got)
            self.names.update(names)
            self.samples.append({"t_s": t_s, **values})
        if self.gpu_reason is None:
            self.gpu_samples.append({"t_s": t_s, "gpus": await asyncio.to_thread(
                self.gpu.sample)})

    async def _loop(self) -> None:
        ticks = 1
        while True:
            # fixed cadence from the start; a tick that ran long skips the ones it covered
            due = self._start + ticks * self.interval_s
            await asyncio.sleep(max(due - time.perf_counter(), 0.0))
            await self._tick()
            ticks = max(ticks + 1, int((time.perf_counter() - self._start)
                                       / self.interval_s) + 1)

    async def start(self) -> None:
        self.gpu_reason = await asyncio.to_thread(self.gpu.open)
        self._start = time.perf_counter()
        await self._tick()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            await self._tick()  # the phase's end
        self.gpu.close()

    def result(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {"available": bool(self.samples),
                                   "failed_scrapes": len(self.failures)}
        if self.samples:
            metrics.update(series=dict(sorted(self.names.items())), samples=self.samples)
        else:
            metrics["reason"] = self.failures[0] if self.failures else "no scrape ran"
        gpu: dict[str, Any] = {"available": self.gpu_reason is None}
        if self.gpu_reason is not None:
            gpu["reason"] = self.gpu_reason
        else:
            gpu.update(devices=self.gpu.devices, samples=self.gpu_samples)
        return {"interval_s": self.interval_s, "metrics": metrics, "gpu": gpu}
