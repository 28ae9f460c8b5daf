"""What ``bench serve`` records around a measured phase besides its own requests.

``async with PhaseWatch(cfg, mode, ...) as watch:`` around the phase's requests:

- before it: the target's caches reset (cold phases, ``--reset-caches``, see
  :mod:`~aphrodite_cli.bench.load.cache_reset`), then ``/metrics`` scraped, then the probes
  started (``--probe-request-rate``, see :mod:`~aphrodite_cli.bench.load.probes`), then the
  CPU time of the target's processes read (``--server-cpu``, see
  :mod:`~aphrodite_cli.bench.load.server_cpu`);
- after it: the CPU time read again, the probes stopped and waited for, ``/metrics`` scraped
  again.

``watch.annotate(result, dataset, records, duration)`` then adds to the phase's result:
``cache_reset``, ``server_metrics`` (see :mod:`~aphrodite_cli.bench.load.scrape`),
``server_cpu``, ``probes``,
``slices`` (``--slice-seconds``, see :mod:`~aphrodite_cli.bench.results.intervals`),
``telemetry`` (``--metrics-interval``: /metrics and the GPUs over the phase, see
:mod:`~aphrodite_cli.bench.load.telemetry`),
``by_kind`` / ``by_modality`` and ``mm_tokens`` (see
:mod:`~aphrodite_cli.bench.load.archetypes`), and ``warnings`` (sentences: what the run could
not confirm, e.g. a cache hit rate the server counted that contradicts the phase's claim).
"""

from __future__ import annotations

import contextlib
from typing import Any

from aphrodite_cli.bench.load import archetypes, cache_reset, scrape
from aphrodite_cli.bench.load.client import LoadConfig, server_root
from aphrodite_cli.bench.load.probes import Probes
from aphrodite_cli.bench.load.server_cpu import CpuWatch
from aphrodite_cli.bench.load.telemetry import Telemetry
from aphrodite_cli.bench.results.intervals import slices


class PhaseWatch:
    def __init__(self, cfg: LoadConfig, mode: str, *, reset_caches: bool = True,
                 scrape_metrics: bool = True, probe_rate: float | None = None,
                 slice_seconds: float | None = None, server_cpu: bool = True,
                 claim: bool = True, metrics_interval: float | None = None) -> None:
        self.cfg, self.mode = cfg, mode
        # whether the phase claims its mode's cache state for every request (a session's
        # later turns resend its media, so a cold phase of sessions has processor cache hits)
        self.claim = claim
        self.reset_caches, self.scrape_metrics = reset_caches, scrape_metrics
        self.probe_rate, self.slice_seconds = probe_rate, slice_seconds
        self.reset: dict[str, Any] | None = None
        self.before: dict[str, float] | str | None = None
        self.after: dict[str, float] | str | None = None
        self.probes: Probes | None = None
        self.cpu = CpuWatch(cfg.target.base_url) if server_cpu else None
        self.cpu_result: dict[str, Any] | None = None
        self.telemetry = Telemetry(self.root, metrics_interval, api_key=cfg.target.api_key,
                                   headers=cfg.target.headers) if metrics_interval else None
        self._stack = contextlib.AsyncExitStack()

    @property
    def root(self) -> str:
        return server_root(self.cfg.target.base_url)

    async def __aenter__(self) -> PhaseWatch:
        if self.reset_caches and self.mode == "cold":
            self.reset = await cache_reset.reset_caches(
                self.root, self.cfg.target.admin_api_key or self.cfg.target.api_key,
                extra_headers=self.cfg.target.headers)
        if self.scrape_metrics:
            self.before = await scrape.scrape(self.root, self.cfg.target.api_key,
                                             extra_headers=self.cfg.target.headers)
        if self.probe_rate:
            self.probes = await self._stack.enter_async_context(
                Probes(self.cfg, self.probe_rate, self.cfg.seed))
        if self.cpu is not None:
            self.cpu.start()
        if self.telemetry is not None:
            await self.telemetry.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if self.telemetry is not None:
            await self.telemetry.stop()
        if self.cpu is not None:
            self.cpu.stop()
        await self._stack.aclose()
        if self.scrape_metrics and exc_type is None:
            self.after = await scrape.scrape(self.root, self.cfg.target.api_key,
                                             extra_headers=self.cfg.target.headers)

    def annotate(self, result: dict[str, Any], dataset: list[Any], records: list[Any],
                 duration: float) -> dict[str, Any]:
        """Add what was watched to the phase's ``result`` (in place; returned)."""
        warnings: list[str] = result.setdefault("warnings", [])
        if self.reset is not None:
            result["cache_reset"] = self.reset
            for route, r in self.reset.items():
                if r["status"] not in ("reset", "no cache"):
                    warnings.append(f"{route}: {r['status']}"
                                    + (f" (HTTP {r['http']})" if r["http"] else "")
                                    + ": the target's cache was not emptied before this phase")
        if self.before is not None and self.after is not None:
            metrics = scrape.phase_metrics(self.before, self.after,
                                           self.mode if self.claim else "sessions")
            result["server_metrics"] = metrics
            if metrics.get("check") not in (None, "ok"):
                warnings.append(metrics["check"])
        if self.cpu is not None:
            result["server_cpu"] = self.cpu.result(result.get("completed") or 0, duration)
        if self.probes is not None:
            result["probes"] = self.probes.result()
        if self.telemetry is not None:
            result["telemetry"] = self.telemetry.result()
        if self.slice_seconds:
            result["slices"] = slices(records, self.slice_seconds)
        result.update(archetypes.breakdown(dataset, records, duration,
                                           self.cfg.goodput))
        result["mm_tokens"] = archetypes.mm_token_summary(records, duration)
        return result
