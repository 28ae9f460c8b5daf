"""Summary statistics and the confidence intervals, each written down once:

- :func:`percentile` (linear interpolation, numpy's default) and :func:`summary`;
- :func:`t_interval`: the mean of a few values (runs) and its 95% Student t-interval
  (``bench serve --num-runs``);
- :func:`ratio_ci`: the ratio of two samples' medians and its 95% percentile-bootstrap
  interval (the gate);
- :func:`percentile_interval`: a percentile of one sample and its 95% percentile-bootstrap
  interval (``bench sweep``'s SLOs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

#: t(0.975, df) for df = 1..30; beyond, the normal quantile's neighbourhood (1.96 at infinity)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
#: what :func:`t_interval`'s results name as their method
T_METHOD = "Student t-interval of the per-run values"
#: the most resampled values :func:`ratio_ci` holds at once per side (8 MB of float64)
BOOTSTRAP_CELLS = 1 << 20


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


def t975(df: int) -> float:
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def t_interval(values: list[float]) -> dict[str, Any]:
    """Mean and its 95% t-interval (low = high = mean for one value: no spread known)."""
    n = len(values)
    if not n:
        return {"n": 0, "mean": None, "low": None, "high": None, "method": T_METHOD}
    mean = statistics.fmean(values)
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "method": T_METHOD}


def ratio_ci(base: np.ndarray, cand: np.ndarray, *, resamples: int = 2000, seed: int = 0
             ) -> tuple[float, float, float]:
    """Median ratio and its 95% percentile-bootstrap interval, resampled a block of
    resamples at a time (memory: a block times the samples, not every resample at once)."""
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    block = max(1, min(resamples, BOOTSTRAP_CELLS // max(base.size, cand.size, 1)))
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        b = rng.choice(base, size=(rows, base.size))
        c = rng.choice(cand, size=(rows, cand.size))
        ratios[start:start + rows] = np.median(c, axis=1) / np.maximum(np.median(b, axis=1),
                                                                        1e-12)
    return (float(np.median(cand) / max(np.median(base), 1e-12)),
            float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5)))


def percentile_interval(values: list[float], pct: float, *, resamples: int = 1000,
                        seed: int = 0) -> dict[str, float | None]:
    """The ``pct``-th percentile of ``values`` and its 95% percentile-bootstrap interval."""
    if not values:
        return {"value": None, "low": None, "high": None}
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    boot = np.percentile(rng.choice(data, size=(resamples, data.size)), pct, axis=1)
    return {"value": float(np.percentile(data, pct)),
            "low": float(np.percentile(boot, 2.5)), "high": float(np.percentile(boot, 97.5))}
