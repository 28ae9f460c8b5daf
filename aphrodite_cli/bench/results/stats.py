"""Summary statistics, written down once: percentiles by linear interpolation."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default 'linear' method)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """mean, median, std (sample), p90, p99, min, max, count."""
    if not values:
        return {"count": 0}
    return {"count": len(values), "mean": statistics.fmean(values),
            "median": percentile(values, 50), "std": statistics.stdev(values)
            if len(values) > 1 else 0.0, "p90": percentile(values, 90),
            "p99": percentile(values, 99), "min": min(values), "max": max(values)}
