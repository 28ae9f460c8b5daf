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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aphrodite_cli.bench.load.metrics import RequestRecord


@dataclass(frozen=True)
class Point:
    """What the search reads of a measured point (the sweep's point dict holds more)."""

    kind: str  # rate, synchronous, saturation or concurrency: only rate points are searched
    offered_rate: float | None  # None: no schedule (one at a time, all at once, closed loop)
    met: bool  # nothing failed, it kept up and every SLO's upper bound is within its limit
    kept_up: bool  # the client sent, and the server completed, at the schedule's rate
    served_rate: float | None = None
    scheduled_rate: float | None = None
    sent_rate: float | None = None
    sustained_rate: float | None = None
    slos: tuple[dict[str, Any], ...] = ()  # each SLO's interval and verdict

    @classmethod
    def of(cls, point: dict[str, Any]) -> Point:
        """The search's view of a sweep point (``Sweep.point``'s dict)."""
        return cls(point["kind"], point["offered_rate"], point["met"], point["kept_up"],
                   point["served_rate"], point["scheduled_rate"], point["sent_rate"],
                   point["sustained_rate"], tuple(point["slos"]))


def sustained_rate(records: list[RequestRecord]) -> float | None:
    """Completed requests over the span from the point's first send to its last completion
    (None: nothing completed)."""
    sent = [r.sent_at for r in records if r.sent_at]
    done = [r.sent_at + r.e2e for r in records if r.ok and r.e2e is not None]
    if not done or not sent or max(done) <= min(sent):
        return None
    return len(done) / (max(done) - min(sent))


def point_capacity(point: Point) -> float | None:
    """The rate a met point shows the server sustains: its sustained rate, at most the rate
    its schedule offered."""
    rates = [r for r in (point.sustained_rate, point.scheduled_rate)
             if r is not None and math.isfinite(r)]
    return min(rates) if rates and point.sustained_rate is not None else None


def _bracket(points: Sequence[Point]) -> tuple[Point | None, Point | None]:
    """(the highest met rate point below the lowest failing one, that failing one)."""
    rates = [p for p in points if p.kind == "rate" and p.offered_rate]
    failing = min((p for p in rates if not p.met), key=lambda p: p.offered_rate or 0.0,
                  default=None)
    top = failing.offered_rate if failing and failing.offered_rate else math.inf
    met = max((p for p in rates if p.met and (p.offered_rate or 0.0) < top),
              key=lambda p: p.offered_rate or 0.0, default=None)
    return met, failing


def _rate(point: Point) -> float:
    """A bracket's point's offered rate (:func:`_bracket` takes only points that have one)."""
    return point.offered_rate or 0.0


async def search(measure: Callable[[float], Awaitable[Point]], sync: Point, saturation: Point,
                 measured: Sequence[Point] = (), *, rate_precision: float = 0.05,
                 max_points: int = 12) -> dict[str, Any]:
    """The capacity from the bounds (``sync``: one request at a time; ``saturation``: all at
    once) and the points ``measured`` already (the sweep profile's rate points are reused):
    bracket, then bisect on the offered rate until the bracket is narrower than
    ``rate_precision`` (a share of its top), measuring at most ``max_points`` new points with
    ``measure(rate)``; the capacity is the best met point's sustained rate."""
    top = saturation.served_rate or sync.served_rate
    if not sync.met or not top:
        return {"rate": None, "limited_by": "slo", "point": None,
                "why": "the SLOs are not met even one request at a time"}
    points = list(measured)
    tries = 0

    async def at(rate: float) -> tuple[Point | None, Point | None]:
        nonlocal tries
        tries += 1
        points.append(await measure(rate))
        return _bracket(points)

    low, high = _bracket(points)
    if high is None and (low is None or _rate(low) < top):
        low, high = await at(top)  # the burst's rate, offered steadily: an upper bracket
    while high is None and tries < max_points:
        # the server kept up with the burst's rate: it may sustain more than a burst shows
        low, high = await at(max(p.offered_rate or 0.0 for p in points if p.kind == "rate")
                             * 1.5)
    if high is None:
        return _result(low, None, "the search's point budget ran out while every rate met "
                       "the SLOs (--rate-precision, or a faster server than the bounds show)")
    # below the failing rate (a server can serve one at a time faster than a burst), so the
    # bracket is never upside down
    probe = min(sync.served_rate or top / 8, _rate(high) / 2)
    while low is None and tries < max_points:
        low, high = await at(probe)
        probe /= 2
    if low is None or high is None:
        return {"rate": None, "limited_by": "slo", "point": None,
                "why": f"no rate down to {probe * 2:.3g}/s met the SLOs"}
    while (_rate(high) - _rate(low)) / _rate(high) > rate_precision and tries < max_points:
        low, failing = await at((_rate(low) + _rate(high)) / 2)
        high = failing or high  # (a failing point never leaves the points: always one)
    return _result(low, high, None)


def _result(low: Point | None, high: Point | None, why: str | None) -> dict[str, Any]:
    if low is None:
        return {"rate": None, "limited_by": "slo", "point": None, "why": why}
    limited = "search" if high is None else ("saturation" if not high.kept_up else "slo")
    return {
        "rate": point_capacity(low), "limited_by": limited, "point": list(low.slos),
        # the point it was measured at: what was offered, scheduled, sent and served there
        "offered_rate": low.offered_rate, "scheduled_rate": low.scheduled_rate,
        "sent_rate": low.sent_rate, "served_rate": low.served_rate,
        "sustained_rate": low.sustained_rate,
        "bracket": [low.offered_rate, high.offered_rate if high else None],
        "why": why or ("above it the server no longer kept up with the offered rate"
                       if limited == "saturation" else "above it an SLO's interval crossed "
                       "its limit")}
