"""The capacity under SLOs: the highest rate the server *served through a whole point* with
every SLO met, searched over measured rate points.

What counts, and why:
- Only open-loop rate points count. The synchronous point (one at a time) and the saturation
  point (all at once) only bracket the search: a burst's completions per second is not a rate
  anyone can offer (the server works through a queue that a steady load never builds).
- A point meets the SLOs when nothing failed, the client sent at the schedule's rate, the
  server's completions kept up with it, and every SLO percentile's upper 95% bound is within
  its limit (see :mod:`aphrodite_cli.bench.load.sweep`).
- The capacity is that point's *sustained rate*: its completed requests over the span from its
  first send to its last completion (never above the schedule's own rate). A server cannot
  complete more requests in a span than its real limit allows, queueing and overhead
  included, so this is at or below what the server can sustain: an offered rate the server only
  seemed to keep up with, with a backlog growing toward the end, is not a capacity.
- The search is conservative: the bracket's top is the lowest offered rate that failed, its
  bottom the highest met rate below that; a lucky met point above a failing one is ignored.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from aphrodite_cli.bench.load.metrics import RequestRecord

if TYPE_CHECKING:
    from aphrodite_cli.bench.load.sweep import Sweep


def sustained_rate(records: list[RequestRecord]) -> float | None:
    """Completed requests over the span from the point's first send to its last completion
    (None: nothing completed)."""
    sent = [r.sent_at for r in records if r.sent_at]
    done = [r.sent_at + r.e2e for r in records if r.ok and r.e2e is not None]
    if not done or not sent or max(done) <= min(sent):
        return None
    return len(done) / (max(done) - min(sent))


def point_capacity(point: dict[str, Any]) -> float | None:
    """The rate a met point shows the server sustains: its sustained rate, at most the rate
    its schedule offered."""
    rates = [r for r in (point.get("sustained_rate"), point.get("scheduled_rate"))
             if r is not None and math.isfinite(r)]
    return min(rates) if rates and point.get("sustained_rate") is not None else None


def _bracket(sweep: Sweep) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the highest met rate point below the lowest failing one, that failing one)."""
    rates = [p for p in sweep.points if p["kind"] == "rate" and p["offered_rate"]]
    failing = min((p for p in rates if not p["met"]), key=lambda p: p["offered_rate"],
                  default=None)
    top = failing["offered_rate"] if failing else math.inf
    met = max((p for p in rates if p["met"] and p["offered_rate"] < top),
              key=lambda p: p["offered_rate"], default=None)
    return met, failing


async def search(sweep: Sweep) -> dict[str, Any]:
    """Bracket with the bounds (reusing any rate points already measured, as the sweep
    profile's), then bisect on the offered rate until the bracket is narrower than
    ``--rate-precision``; the capacity is the best met point's sustained rate."""
    settings = sweep.settings
    sync, saturation = await sweep.bounds()
    top = saturation["served_rate"] or sync["served_rate"]
    if not sync["met"] or not top:
        return {"rate": None, "limited_by": "slo", "point": None,
                "why": "the SLOs are not met even one request at a time"}
    tries = 0

    async def measure(rate: float) -> None:
        nonlocal tries
        tries += 1
        await sweep.point(rate=rate)

    low, high = _bracket(sweep)
    if high is None and (low is None or low["offered_rate"] < top):
        await measure(top)  # the burst's rate, offered steadily: an upper bracket to test
        low, high = _bracket(sweep)
    while high is None and tries < settings.max_search_points:
        # the server kept up with the burst's rate: it may sustain more than a burst shows
        await measure(max(p["offered_rate"] for p in sweep.points if p["kind"] == "rate") * 1.5)
        low, high = _bracket(sweep)
    if high is None:
        return _result(low, None, "the search's point budget ran out while every rate met "
                       "the SLOs (--rate-precision, or a faster server than the bounds show)")
    # below the failing rate (a server can serve one at a time faster than a burst), so the
    # bracket is never upside down
    probe = min(sync["served_rate"] or top / 8, high["offered_rate"] / 2)
    while low is None and tries < settings.max_search_points:
        await measure(probe)
        low, high = _bracket(sweep)
        probe /= 2
    if low is None:
        return {"rate": None, "limited_by": "slo", "point": None,
                "why": f"no rate down to {probe * 2:.3g}/s met the SLOs"}
    while (high["offered_rate"] - low["offered_rate"]) / high["offered_rate"] > \
            settings.rate_precision and tries < settings.max_search_points:
        await measure((low["offered_rate"] + high["offered_rate"]) / 2)
        low, high = _bracket(sweep)
    return _result(low, high, None)


def _result(low: dict[str, Any] | None, high: dict[str, Any] | None,
            why: str | None) -> dict[str, Any]:
    if low is None:
        return {"rate": None, "limited_by": "slo", "point": None, "why": why}
    limited = "search" if high is None else ("saturation" if not high["kept_up"] else "slo")
    return {
        "rate": point_capacity(low), "limited_by": limited, "point": low["slos"],
        # the point it was measured at: what was offered, scheduled, sent and served there
        "offered_rate": low["offered_rate"], "scheduled_rate": low["scheduled_rate"],
        "sent_rate": low["sent_rate"], "served_rate": low["served_rate"],
        "sustained_rate": low["sustained_rate"],
        "bracket": [low["offered_rate"], high["offered_rate"] if high else None],
        "why": why or ("above it the server no longer kept up with the offered rate"
                       if limited == "saturation" else "above it an SLO's interval crossed "
                       "its limit")}
