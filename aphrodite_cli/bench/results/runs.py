"""``bench serve --num-runs N``: the same benchmark N times against one target, with a 95%
confidence interval for each headline metric across the runs, and the gate's run-level check.

Method: Student's t-interval of the mean of the N per-run values, mean +- t(0.975, N-1) x
s / sqrt(N) (s: the runs' sample standard deviation). Runs are the unit because run-to-run
noise (placement, caches, other tenants) is what a single run's request-level bootstrap
cannot see; the t-interval is exact for normal per-run values and close for the run-level
means and medians measured here.

The result keeps every run: a phase's ``runs`` lists each run's headline metrics, ``ci95``
holds the interval per metric, ``samples`` pool the requests of every run (what the gate's
request-level comparison pools), and the phase's other fields are the first run's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.escape import markdown_safe as _md
from aphrodite_cli.bench.results.stats import t_interval

#: The headline metrics: name -> (path in a phase result, higher is better)
HEADLINE: dict[str, tuple[tuple[str, ...], bool]] = {
    "request_throughput": (("request_throughput",), True),
    "output_throughput": (("output_throughput",), True),
    "total_token_throughput": (("total_token_throughput",), True),
    "input_token_throughput": (("input_token_throughput",), True),
    "output_token_throughput_per_user_p50": (("output_token_throughput_per_user", "median"),
                                             True),
    "ttft_ms_p50": (("ttft_ms", "median"), False),
    "ttft_ms_p99": (("ttft_ms", "p99"), False),
    "tpot_ms_p50": (("tpot_ms", "median"), False),
    "ttst_ms_p50": (("ttst_ms", "median"), False),
    "e2e_ms_p50": (("e2e_ms", "median"), False),
    "e2e_ms_p99": (("e2e_ms", "p99"), False),
}


def _get(phase: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = phase
    for key in path:
        value = (value or {}).get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def headline(phase: dict[str, Any]) -> dict[str, float | None]:
    return {name: _get(phase, path) for name, (path, _) in HEADLINE.items()}


def _pool(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, values in more.items():
        if isinstance(values, list):
            into.setdefault(key, []).extend(values)
        elif isinstance(values, dict):
            _pool(into.setdefault(key, {}), values)


#: A phase's sections kept per run with --num-runs (a time series or a table per turn has no
#: pooled form: each run's is kept, the first run's also where one run's would be)
PER_RUN = ("per_turn", "telemetry")


def combine(docs: list[dict[str, Any]], rows: list[dict[str, list[dict[str, Any]]]]
            ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """N runs' (result, rows) -> one result: the first run's, with ``runs``, ``ci95`` and
    pooled ``samples`` per phase, every run's own series (``per_run``: each run's
    :data:`PER_RUN` sections, which do not pool: per-turn tables, telemetry over time), and
    every run's rows (each with its ``run``)."""
    doc = docs[0]
    for mode, phase in doc["phases"].items():
        per_run = [d["phases"][mode] for d in docs if mode in d["phases"]]
        phase["runs"] = [headline(p) for p in per_run]
        if any(p.get(key) for p in per_run for key in PER_RUN):
            phase["per_run"] = [{key: p.get(key) for key in PER_RUN} for p in per_run]
        phase["ci95"] = {name: t_interval([v for r in phase["runs"]
                                           if (v := r[name]) is not None])
                         for name in HEADLINE}
        samples: dict[str, Any] = {}
        for p in per_run:
            _pool(samples, p.get("samples") or {})
        phase["samples"] = samples
    doc["num_runs"] = len(docs)
    merged: dict[str, list[dict[str, Any]]] = {}
    for n, run_rows in enumerate(rows, 1):
        for mode, mode_rows in run_rows.items():
            merged.setdefault(mode, []).extend({**r, "run": n} for r in mode_rows)
    return doc, merged


def compare(baseline: list[Path], candidate: list[Path], thresholds: dict[str, float],
            default: float) -> list[dict[str, Any]]:
    """The gate's run-level check, for phases both sides ran with ``--num-runs`` >= 2: a
    headline metric regresses when the candidate's 95% interval lies wholly on the worse side
    of the baseline's, beyond the threshold (latency: candidate low > baseline high x (1 +
    threshold); throughput: candidate high < baseline low x (1 - threshold))."""
    from aphrodite_cli.bench.results.files import load_result

    def intervals(paths: list[Path]) -> dict[tuple[str, str], dict[str, Any]]:
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for path in paths:
            doc = load_result(path, ("serve",))
            for mode, phase in (doc.get("phases") or {}).items():
                for name, ci in (phase.get("ci95") or {}).items():
                    if (ci or {}).get("n", 0) >= 2:
                        out[(mode, name)] = ci
        return out

    if not all(_is_serve(p) for p in [*baseline, *candidate]):
        return []
    base, cand = intervals(baseline), intervals(candidate)
    verdicts = []
    for key in sorted(set(base) & set(cand)):
        mode, name = key
        b, c = base[key], cand[key]
        higher_better = HEADLINE[name][1]
        # ttft_ms_p50 takes --threshold ttft_ms_p50:..., else ttft_ms:...
        threshold = thresholds.get(name, thresholds.get(name.rsplit("_", 1)[0], default))
        if higher_better:
            regressed = c["high"] < b["low"] * (1 - threshold)
            improved = c["low"] > b["high"] * (1 + threshold)
        else:
            regressed = c["low"] > b["high"] * (1 + threshold)
            improved = c["high"] < b["low"] * (1 - threshold)
        verdicts.append({"phase": mode, "metric": name, "baseline": b, "candidate": c,
                         "threshold": threshold, "regressed": regressed,
                         "improved": improved})
    return verdicts


def _is_serve(path: Path) -> bool:
    import json

    try:
        return json.loads(Path(path).read_text()).get("kind") == "serve"
    except (OSError, ValueError, AttributeError):
        return False


def markdown(verdicts: list[dict[str, Any]]) -> str:
    rows = ["| phase | run-level metric | baseline mean [95% CI] | candidate mean [95% CI] | "
            "verdict |", "|---|---|---|---|---|"]
    for v in verdicts:
        b, c = v["baseline"], v["candidate"]
        verdict = ("**regression**" if v["regressed"] else "improvement" if v["improved"]
                   else "no significant change")
        rows.append(f"| {_md(v['phase'])} | {v['metric']} | {b['mean']:.4g} [{b['low']:.4g}, "
                    f"{b['high']:.4g}] (n={b['n']}) | {c['mean']:.4g} [{c['low']:.4g}, "
                    f"{c['high']:.4g}] (n={c['n']}) | {verdict} (threshold "
                    f"{v['threshold']:.0%}) |")
    return "\n".join(rows)
