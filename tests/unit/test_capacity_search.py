"""The capacity search (``bench sweep --slo``) as a pure bisection: it is fed a server model,
a function from an offered rate to the measured ``Point`` (its verdict included), so every
branch runs in microseconds and gives the same answer every time. (The sweep's own
measuring is tested against the mock server in tests/bench/test_sweep.py.)"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest

from aphrodite_cli.bench.load.capacity import Point, search

CAPACITY = 40.0  # requests/s the modelled server sustains


def served(rate: float, capacity: float = CAPACITY, slo_limit: float = math.inf) -> Point:
    """A rate point on a server of ``capacity``: below it the server keeps up (and sustains
    a little less than offered: its overhead), above it a backlog grows; ``slo_limit``: the
    rate above which an SLO's interval crosses its limit although the server keeps up."""
    kept_up = rate <= capacity
    return Point("rate", rate, kept_up and rate <= slo_limit, kept_up,
                 served_rate=min(rate, capacity), scheduled_rate=rate * 0.99,
                 sent_rate=rate, sustained_rate=min(rate, capacity) * 0.97,
                 slos=({"slo": "e2e p90 <= 150 ms", "met": rate <= slo_limit},))


SYNC = Point("synchronous", None, True, True, served_rate=10.0)
#: the burst's completions per second: above what the server sustains at a steady rate
BURST = Point("saturation", None, False, True, served_rate=CAPACITY * 1.06)


def run(model: Callable[[float], Point], sync: Point = SYNC, saturation: Point = BURST,
        measured: tuple[Point, ...] = (), **settings) -> tuple[dict, list[float]]:
    asked: list[float] = []

    async def measure(rate: float) -> Point:
        asked.append(rate)
        return model(rate)

    result = asyncio.run(search(measure, sync, saturation, measured, **settings))
    return result, asked


@pytest.mark.parametrize("precision", [0.05, 0.01])
def test_the_search_brackets_the_capacity_to_the_precision_and_never_above(precision):
    result, asked = run(served, rate_precision=precision, max_points=30)
    low, high = result["bracket"]
    assert low <= CAPACITY < high and (high - low) / high <= precision
    # the capacity is what the best met point sustained: never its offered rate, never the
    # burst's rate, never above what was scheduled there
    assert result["offered_rate"] == low
    assert result["rate"] == pytest.approx(low * 0.97)
    assert result["rate"] <= result["scheduled_rate"] < CAPACITY
    assert result["limited_by"] == "saturation" and result["point"][0]["met"]
    # the burst's rate offered steadily (fails), a probe below it (the synchronous rate:
    # met), then midpoints of the bracket
    assert asked[:2] == [BURST.served_rate, SYNC.served_rate]
    assert all(SYNC.served_rate < rate < BURST.served_rate for rate in asked[2:])
    assert run(served, rate_precision=precision, max_points=30) == (result, asked)


def test_an_slo_crossed_before_saturation_names_the_slo():
    result, _ = run(lambda rate: served(rate, slo_limit=25.0), max_points=30)
    low, high = result["bracket"]
    assert low <= 25.0 < high and result["limited_by"] == "slo"
    assert "SLO" in result["why"]


def test_the_measured_points_are_reused_and_a_lucky_met_point_above_a_failure_ignored():
    """The profile's rate points bracket already: no bound is measured again, and a met point
    above the lowest failing rate (noise) does not raise the capacity."""
    lucky = Point("rate", 60.0, True, True, 60.0, 60.0, 60.0, 58.0)
    measured = (SYNC, BURST, served(20.0), served(45.0), lucky)
    result, asked = run(served, measured=measured, rate_precision=0.05)
    assert asked[0] == (20.0 + 45.0) / 2  # straight to bisection between the profile's points
    assert result["bracket"][1] <= 45.0 and result["rate"] < CAPACITY


def test_no_capacity_when_one_request_at_a_time_misses_the_slo():
    result, asked = run(served, sync=Point("synchronous", None, False, True, served_rate=8.0))
    assert result["rate"] is None and asked == []
    assert result["why"] == "the SLOs are not met even one request at a time"


def test_no_capacity_when_no_rate_down_to_the_probes_meets_it():
    result, asked = run(lambda rate: served(rate, slo_limit=0.0), max_points=6)
    assert result["rate"] is None and result["limited_by"] == "slo" and len(asked) == 6
    # the probes halve from below the failing rate
    assert asked[1] == SYNC.served_rate and asked[2:] == [5.0, 2.5, 1.25, 0.625]
    assert result["why"] == "no rate down to 0.625/s met the SLOs"


def test_a_server_faster_than_the_bounds_ends_on_the_point_budget():
    result, asked = run(lambda rate: served(rate, capacity=1e9), max_points=4)
    assert len(asked) == 4 and asked[1:] == [asked[0] * 1.5, asked[0] * 2.25,
                                             asked[0] * 3.375]
    assert result["limited_by"] == "search" and result["bracket"][1] is None
    assert result["offered_rate"] == max(asked) and "budget" in result["why"]


def test_the_point_budget_stops_the_bisection():
    result, asked = run(served, rate_precision=1e-9, max_points=5)
    assert len(asked) == 5 and result["rate"] is not None


def test_a_sweep_point_is_read_into_a_point():
    """The keys ``Sweep.point`` writes, read into what the search uses."""
    point = {"kind": "rate", "offered_rate": 12.0, "scheduled_rate": 11.9, "sent_rate": 11.8,
             "concurrency": None, "requests": 120, "served_rate": 11.5,
             "sustained_rate": 11.2, "kept_up": True, "slos": [{"met": True}], "met": True,
             "result": {}}
    assert Point.of(point) == Point("rate", 12.0, True, True, 11.5, 11.9, 11.8, 11.2,
                                    ({"met": True},))
