"""The regression gate: candidate vs baseline, aware of noise.

For each metric, the per-request samples of every baseline file are pooled, likewise the
candidate's, and the ratio of medians (candidate / baseline) gets a 95% bootstrap confidence
interval (seeded, 2000 resamples). A latency metric regresses when the whole interval lies
above 1 + threshold: a slowdown the noise cannot explain. Run several repeats per side to
catch run-to-run noise, not just request-to-request noise. A metric where higher is better
(:data:`HIGHER_IS_BETTER`: output tokens per second per user) regresses when the whole
interval lies below 1 - threshold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aphrodite_cli.bench.results.escape import markdown_safe as _md
from aphrodite_cli.bench.results.files import load_result
from aphrodite_cli.bench.results.stats import ratio_ci
from engine.errors import ConfigError

DEFAULT_THRESHOLD = 0.05
DEFAULT_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "ttst_ms", "output_token_throughput_per_user",
                   "total_ms")
#: Sample metrics where a larger value is the better one
HIGHER_IS_BETTER = frozenset({"output_token_throughput_per_user"})
#: the most samples per metric and side the gate compares (more are thinned evenly)
MAX_SAMPLES = 20_000


@dataclass
class Verdict:
    metric: str
    phase: str
    baseline_median: float
    candidate_median: float
    ratio: float
    low: float
    high: float
    threshold: float
    n_baseline: int
    n_candidate: int

    @property
    def regressed(self) -> bool:
        if self.metric in HIGHER_IS_BETTER:
            return self.high < 1 - self.threshold
        return self.low > 1 + self.threshold

    @property
    def improved(self) -> bool:
        if self.metric in HIGHER_IS_BETTER:
            return self.low > 1 + self.threshold
        return self.high < 1 - self.threshold


def samples(paths: list[Path]) -> dict[tuple[str, str], list[float]]:
    """(phase, metric) -> pooled samples from result files (each checked by its kind's
    model: finite numbers, at least 0). Past :data:`MAX_SAMPLES` per side a metric keeps an
    evenly spread :data:`MAX_SAMPLES` of them (the same every time), so the gate's memory is
    bounded whatever the files hold."""
    pooled: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        doc = load_result(path, ("serve", "mm-processor"))
        for phase, result in (doc.get("phases") or {}).items():
            for metric, values in (result.get("samples") or {}).items():
                if isinstance(values, list) and values and isinstance(values[0], int | float):
                    pooled.setdefault((phase, metric), []).extend(float(v) for v in values)
    return {key: _thinned(values) for key, values in pooled.items()}


def _thinned(values: list[float]) -> list[float]:
    """At most :data:`MAX_SAMPLES` of ``values``, spread evenly over them."""
    if len(values) <= MAX_SAMPLES:
        return values
    picks = np.linspace(0, len(values) - 1, MAX_SAMPLES).round().astype(np.int64)
    return np.asarray(values)[picks].tolist()


def compare(baseline: list[Path], candidate: list[Path], thresholds: dict[str, float] | None = None,
            metrics: tuple[str, ...] = DEFAULT_METRICS) -> list[Verdict]:
    base, cand = samples(baseline), samples(candidate)
    verdicts = []
    for key in sorted(set(base) & set(cand)):
        phase, metric = key
        if metric not in metrics or len(base[key]) < 5 or len(cand[key]) < 5:
            continue
        threshold = (thresholds or {}).get(metric, DEFAULT_THRESHOLD)
        b, c = np.asarray(base[key]), np.asarray(cand[key])
        ratio, low, high = ratio_ci(b, c)
        verdicts.append(Verdict(metric, phase, float(np.median(b)), float(np.median(c)), ratio,
                                low, high, threshold, b.size, c.size))
    if not verdicts:
        raise ConfigError("no metric has samples in both baseline and candidate",
                          hint="compare result files of the same kind (bench serve or "
                               "mm-processor) written by this version")
    return verdicts


def markdown(verdicts: list[Verdict]) -> str:
    rows = ["| phase | metric | baseline median | candidate median | ratio | 95% CI | verdict |",
            "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        verdict = ("**regression**" if v.regressed else "improvement" if v.improved
                   else "no significant change")
        rows.append(f"| {_md(v.phase)} | {v.metric} | {v.baseline_median:.2f} | "
                    f"{v.candidate_median:.2f} | {v.ratio:.3f} | [{v.low:.3f}, {v.high:.3f}] | "
                    f"{verdict} (threshold {v.threshold:.0%}) |")
    return "\n".join(rows)


def parse_thresholds(text: str | None) -> dict[str, float]:
    """``ttft_ms:10%,e2e_ms:5%`` -> {"ttft_ms": 0.10, "e2e_ms": 0.05}."""
    out: dict[str, float] = {}
    for part in (p for p in (text or "").split(",") if p.strip()):
        name, _, value = part.partition(":")
        try:
            out[name.strip()] = float(value.strip().rstrip("%")) / 100
        except ValueError:
            raise ConfigError(f"--threshold {part!r} should look like ttft_ms:10%") from None
    return out


def verdicts_json(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    return [{**v.__dict__, "regressed": v.regressed, "improved": v.improved} for v in verdicts]


def _capacities(paths: list[Path]) -> dict[str, list[float]]:
    """phase -> capacities (requests/s) of the sweep result files; a phase searched without
    a rate that met the SLOs counts as capacity 0."""
    out: dict[str, list[float]] = {}
    for path in paths:
        doc = load_result(path, ("sweep",))
        for phase, result in (doc.get("phases") or {}).items():
            if result.get("capacity") is None:
                continue  # measured points only (no --slo): no capacity to compare
            if result["capacity"].get("definition", "sustained") != "sustained":
                raise ConfigError(
                    f"{path} is a sweep of an older aphrodite whose capacity was the offered "
                    "rate, not the sustained rate this one measures (never higher): the two "
                    "cannot be compared", hint="run bench sweep again for that side")
            out.setdefault(phase, []).append(float(result["capacity"].get("rate") or 0.0))
    return out


def is_sweep(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("kind") == "sweep"
    except (OSError, json.JSONDecodeError):
        return False


def compare_capacity(baseline: list[Path], candidate: list[Path],
                     threshold: float = DEFAULT_THRESHOLD) -> list[dict[str, Any]]:
    """Per phase: the candidate's capacity (median over its files) against the baseline's;
    a regression is a drop of more than ``threshold``."""
    base, cand = _capacities(baseline), _capacities(candidate)
    missing = sorted(set(base) - set(cand))
    if missing:
        raise ConfigError(f"the candidate sweeps have no capacity for phase(s) "
                          f"{', '.join(missing)}, which the baseline has",
                          hint="run the candidate with the same --mode and --slo")
    verdicts = []
    for phase in sorted(set(base) & set(cand)):
        b, c = float(np.median(base[phase])), float(np.median(cand[phase]))
        ratio = c / b if b else float("inf")
        verdicts.append({"phase": phase, "metric": "capacity_rps", "baseline": b,
                         "candidate": c, "ratio": ratio, "threshold": threshold,
                         "regressed": ratio < 1 - threshold,
                         "improved": ratio > 1 + threshold})
    if not verdicts:
        raise ConfigError("no phase has a capacity in both baseline and candidate sweeps",
                          hint="run bench sweep with --slo on both sides")
    return verdicts


def capacity_markdown(verdicts: list[dict[str, Any]]) -> str:
    rows = ["| phase | capacity baseline (req/s) | candidate | ratio | verdict |",
            "|---|---|---|---|---|"]
    for v in verdicts:
        verdict = ("**regression**" if v["regressed"] else "improvement" if v["improved"]
                   else "no significant change")
        rows.append(f"| {_md(v['phase'])} | {v['baseline']:.3g} | {v['candidate']:.3g} | "
                    f"{v['ratio']:.3f} | {verdict} (threshold {v['threshold']:.0%}) |")
    return "\n".join(rows)
