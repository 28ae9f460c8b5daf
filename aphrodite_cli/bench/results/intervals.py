"""Time slices (``--slice-seconds S``): a phase's metrics per interval of S seconds, to see a
run change over time (a cache filling, a queue building up, a ramp-up).

Each request belongs to the interval in which it ended: a completed request at its send time
+ E2E, a failed one at its send time (a failure's end is not recorded). Per interval:
``completed``, ``failed``, ``rps`` (completed / S, also for the last interval, marked
``partial`` when the phase ended inside it), ``output_tokens_per_s``, and TTFT and TPOT
p50 / p99 (ms) of the requests completed in it (None where it has none). Times are seconds
after the phase's first send.
"""

from __future__ import annotations

import math
from typing import Any

from aphrodite_cli.bench.results.stats import percentile


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def slices(records: list[Any], seconds: float) -> dict[str, Any]:
    """Per-interval metrics of one phase's request records (see the module docstring)."""
    sent = [r.sent_at for r in records if r.sent_at]
    if not sent or seconds <= 0:
        return {"seconds": seconds, "by": "end time", "intervals": []}
    start = min(sent)
    ends = []
    for r in records:
        if not r.sent_at:
            continue
        end = r.sent_at + (r.e2e if r.ok and r.e2e is not None else 0.0) - start
        ends.append((end, r))
    last = max(end for end, _ in ends)
    count = max(1, math.ceil(last / seconds + 1e-9)) if last > 0 else 1
    buckets: list[list[Any]] = [[] for _ in range(count)]
    for end, r in ends:
        buckets[min(int(end // seconds), count - 1)].append(r)
    intervals = []
    for n, bucket in enumerate(buckets):
        lo = n * seconds
        done = [r for r in bucket if r.ok]
        intervals.append({
            "start_s": round(lo, 6), "end_s": round(lo + seconds, 6),
            # the last interval ends with the phase's last request, maybe before end_s
            "partial": n == count - 1 and last < lo + seconds,
            "completed": len(done),
            "failed": sum(1 for r in bucket if not r.ok and not r.cancelled),
            "cancelled": sum(1 for r in bucket if r.cancelled),
            "rps": len(done) / seconds,
            "output_tokens_per_s": sum(r.output_tokens for r in done) / seconds,
            "ttft_ms": _pcts([r.ttft * 1e3 for r in done if r.ttft is not None]),
            "tpot_ms": _pcts([t * 1e3 for r in done if (t := r.tpot) is not None])})
    return {"seconds": seconds, "by": "end time", "intervals": intervals}
