"""`aphrodite bench sweep`: latency against load, and the highest rate that meets an SLO.

Each point is a `bench serve` measurement (same client, datasets and metrics) at one offered
load: a request rate (open loop, gamma arrivals with ``--burstiness``) or a concurrency
(closed loop). What is measured at a point is its phase result plus two numbers a curve
needs: the *served rate* (completions per second while requests arrive: ``(n - 1)`` over the
span from the first to the last completion, which follows the offered rate while the server
keeps up and stays at its capacity when it does not) and each SLO percentile with its 95%
bootstrap interval.

Profiles (guidellm's idea for the sweep):
- ``--rates`` / ``--concurrencies``: the given points;
- ``sweep``: one request at a time (the synchronous bound), all at once (the saturation
  bound), then ``--num-points`` rates spaced evenly between the two;
- with ``--slo``: the capacity search (:mod:`aphrodite_cli.bench.load.capacity`; with ``--profile
  sweep`` too, after the profile's points, which it reuses). The synchronous and saturation
  runs bound the range, then bisection to ``--rate-precision`` finds the highest offered rate
  at which every SLO holds. A point meets the SLOs only when nothing failed, the client sent
  and the server served at the offered schedule's rate (``KEEP_UP``) and every percentile's
  *upper* interval bound is within its limit, so a noisy machine gives a lower capacity, never
  a lucky higher one. The capacity is what that point's server sustained (completions over
  the point's whole span), never the burst's rate nor an offered rate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aphrodite_cli.bench.data.datasets import nonce
from aphrodite_cli.bench.harness.media_host import MediaHost
from aphrodite_cli.bench.load import capacity as capacity_search
from aphrodite_cli.bench.load.capacity import Point, sustained_rate
from aphrodite_cli.bench.load.client import (
    LoadConfig,
    build_payload,
    phase_result,
    run_phase,
    scheduled_rate,
)
from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.results.stats import percentile_interval
from engine.errors import BenchmarkFailed, ConfigError

#: SLO metric names (vLLM's ``e2el`` too) -> the per-request sample list they read.
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_ms",
               "e2el": "e2e_ms"}
#: A rate point keeps up when its served rate is at least this share of the rate its seeded
#: schedule offered (the schedule's own rate, so the arrivals' randomness cancels out).
KEEP_UP = 0.95


@dataclass(frozen=True)
class Slo:
    metric: str  # ttft, tpot, itl or e2e
    pct: float
    ms: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft:p99:300`` (metric, percentile, milliseconds)."""
        parts = text.split(":")
        try:
            metric, pct, ms = parts[0].strip().lower(), parts[1].strip().lower(), parts[2]
            slo = cls("e2e" if metric == "e2el" else metric, float(pct.removeprefix("p")),
                      float(ms))
        except (IndexError, ValueError):
            raise ConfigError(f"--slo {text!r} should look like ttft:p99:300 (metric, "
                              "percentile, milliseconds)", code="invalid_flag") from None
        if len(parts) != 3 or metric not in SLO_METRICS or not 0 < slo.pct <= 100 or \
                slo.ms <= 0:
            raise ConfigError(f"--slo {text!r}: the metric is one of ttft, tpot, itl, e2e, "
                              "the percentile is p1..p100 and the limit positive ms",
                              code="invalid_flag")
        return slo

    @property
    def label(self) -> str:
        return f"{self.metric} p{self.pct:g} <= {self.ms:g} ms"


def served_rate(records: list[RequestRecord]) -> float | None:
    """Completions per second from the first to the last completion (None: under two)."""
    done = sorted(r.sent_at + r.e2e for r in records if r.ok and r.e2e is not None)
    if len(done) < 2 or done[-1] <= done[0]:
        return None
    return (len(done) - 1) / (done[-1] - done[0])


class Payloads:
    """Request bodies for one phase's points: ``cold`` renders new media for every point (a
    fresh nonce); ``warm`` reuses one pool, sent once unmeasured before the first point."""

    def __init__(self, make: Callable[[int, int], list], cfg: LoadConfig, host: MediaHost | None,
                 mode: str, pool_size: int, seed: int) -> None:
        self.make, self.cfg, self.host, self.mode = make, cfg, host, mode
        self.cache: dict = {}
        self.pool = ([build_payload(r, cfg, host, self.cache) for r in make(pool_size, seed)]
                     if mode == "warm" else [])
        self.cursor = 0

    def take(self, n: int) -> list[tuple[bytes, float]]:
        if self.mode == "cold":  # new media each time: nothing rendered before is sent again
            self.cache.clear()
            if self.host:
                self.host.files.clear()
            return [build_payload(r, self.cfg, self.host, self.cache)
                    for r in self.make(n, nonce())]
        out = [self.pool[(self.cursor + i) % len(self.pool)] for i in range(n)]
        self.cursor += n
        return out


@dataclass
class SweepSettings:
    duration_s: float = 10.0  # of a rate point: rate x duration requests
    min_requests: int = 20  # per point, whatever the rate
    num_warmups: int = 2  # unmeasured requests before each point
    num_points: int = 5  # rates between the bounds, for the sweep profile
    rate_precision: float = 0.05  # the search stops when its bracket is this narrow
    max_search_points: int = 12


class Sweep:
    """Measure points of one phase against the target and search the capacity."""

    def __init__(self, cfg: LoadConfig, payloads: Payloads, settings: SweepSettings,
                 slos: list[Slo], on_point: Callable[[dict[str, Any]], None] | None = None
                 ) -> None:
        self.cfg, self.payloads, self.settings, self.slos = cfg, payloads, settings, slos
        self.on_point = on_point
        self.points: list[dict[str, Any]] = []
        self._bounds: tuple[dict[str, Any], dict[str, Any]] | None = None

    async def point(self, *, rate: float = math.inf, concurrency: int | None = None,
                    kind: str = "rate", requests: int | None = None) -> dict[str, Any]:
        s = self.settings
        if requests is None:
            requests = (max(s.min_requests, math.ceil(rate * s.duration_s))
                        if math.isfinite(rate) else max(s.min_requests, 4 * (concurrency or 1)))
        # The first point stops at once when the target refuses every request alike (a wrong
        # URL, model or key); later points measure whatever happens.
        cfg = replace(self.cfg.with_arrivals(request_rate=rate, max_concurrency=concurrency),
                      abort_after=self.cfg.abort_after if not self.points else 0, goodput={})
        if s.num_warmups:
            await run_phase(self.payloads.take(s.num_warmups),
                            cfg.with_arrivals(request_rate=math.inf,
                                              max_concurrency=concurrency))
        records, duration, send_rate = await run_phase(self.payloads.take(requests), cfg)
        result = phase_result(records, duration, send_rate, cfg)
        served = served_rate(records)
        offered = scheduled_rate(requests, cfg) if math.isfinite(rate) else None
        samples = {
            "ttft_ms": [r.ttft * 1e3 for r in records if r.ok and r.ttft is not None],
            "tpot_ms": [r.tpot * 1e3 for r in records if r.tpot is not None],
            "itl_ms": [g * 1e3 for r in records if r.ok for g in r.itl],
            "e2e_ms": [r.e2e * 1e3 for r in records if r.ok and r.e2e is not None]}
        slo_results = []
        for i, slo in enumerate(self.slos):
            interval = percentile_interval(samples[SLO_METRICS[slo.metric]], slo.pct, seed=i)
            slo_results.append({"slo": slo.label, **interval,
                                "met": interval["high"] is not None and interval["high"]
                                <= slo.ms})
        sent = send_rate if math.isfinite(send_rate) else None
        # kept up: the client sent at the schedule's rate and the server completed at it
        kept_up = offered is None or (served is not None and served >= KEEP_UP * offered
                                      and sent is not None and sent >= KEEP_UP * offered)
        point = {"kind": kind, "offered_rate": rate if math.isfinite(rate) else None,
                 "scheduled_rate": offered, "sent_rate": sent, "concurrency": concurrency,
                 "requests": requests, "served_rate": served,
                 "sustained_rate": sustained_rate(records), "kept_up": kept_up,
                 "slos": slo_results,
                 "met": result["failed"] == 0 and kept_up and all(r["met"] for r in slo_results),
                 "result": {**result, "samples": samples}}
        self.points.append(point)
        if self.on_point:
            self.on_point(point)
        return point

    async def bounds(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The synchronous point (one at a time) and the saturation point (all at once),
        measured once (the profile and the capacity search share them)."""
        if self._bounds is None:
            sync = await self.point(rate=math.inf, concurrency=1, kind="synchronous")
            saturation = await self.point(rate=math.inf, kind="saturation",
                                          requests=max(self.settings.min_requests * 2, 40))
            self._bounds = (sync, saturation)
        return self._bounds

    async def profile(self) -> None:
        """guidellm's sweep: the bounds, then evenly spaced rates between them."""
        sync, saturation = await self.bounds()
        low, high = sync["served_rate"], saturation["served_rate"]
        if not low or not high or high <= low:
            return
        n = self.settings.num_points
        for i in range(1, n + 1):
            await self.point(rate=low + (high - low) * i / (n + 1))

    async def capacity(self) -> dict[str, Any]:
        """The highest rate the server sustained through a whole point with every SLO met
        (:func:`aphrodite_cli.bench.load.capacity.search`), from the bounds and the rate
        points measured so far."""
        sync, saturation = await self.bounds()

        async def measure(rate: float) -> Point:
            return Point.of(await self.point(rate=rate))

        return await capacity_search.search(
            measure, Point.of(sync), Point.of(saturation), [Point.of(p) for p in self.points],
            rate_precision=self.settings.rate_precision,
            max_points=self.settings.max_search_points)


async def run_sweep(cfg: LoadConfig, make: Callable[[int, int], list], *, modes: tuple[str, ...],
                    settings: SweepSettings, slos: list[Slo], rates: list[float],
                    concurrencies: list[int], pool_size: int, seed: int,
                    media_delivery: str, on_point: Callable[[str, dict[str, Any]], None],
                    profile: bool = False) -> dict[str, Any]:
    """Every phase's points (and capacity, with SLOs)."""
    host = MediaHost() if media_delivery == "http" else None
    phases: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        for mode in modes:
            if host:
                host.files.clear()  # the last phase's media: nobody asks for them again
            payloads = Payloads(make, cfg, host, mode, pool_size, seed)
            if mode == "warm":  # the pool, once, so every measured request is a cache hit
                records, _, _ = await run_phase(payloads.pool,
                                                cfg.with_arrivals(request_rate=math.inf))
                failed = [r for r in records if not r.ok]
                if failed:
                    raise BenchmarkFailed(
                        f"{len(failed)} of the warm phase's {len(records)} pool requests failed "
                        f"({failed[0].error}), so its points would not all be cache hits",
                        hint="fix what the failures say, or measure --mode cold")
            sweep = Sweep(cfg, payloads, settings, slos,
                          on_point=lambda p, m=mode: on_point(m, p))
            phase_start = time.perf_counter()
            capacity = None
            if slos:
                if profile:  # the profile's points first; the search reuses them
                    await sweep.profile()
                capacity = await sweep.capacity()
            elif rates or concurrencies:
                for rate in rates:
                    await sweep.point(rate=rate)
                for c in concurrencies:
                    await sweep.point(concurrency=c, kind="concurrency")
            else:
                await sweep.profile()
            phases[mode] = {"points": sweep.points, "capacity": capacity,
                            "seconds": time.perf_counter() - phase_start}
    finally:
        if host:
            host.stop()
    return {"phases": phases, "seconds": time.perf_counter() - start}


def run(cfg: LoadConfig, make: Callable[[int, int], list], **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_sweep(cfg, make, **kwargs))
