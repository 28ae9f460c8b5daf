"""vLLM's `bench serve` conventions, so its scripts and the tools that read its results work
with ours: ``--goodput`` as vLLM writes it, ``--percentile-metrics`` /
``--metric-percentiles``, and vLLM's flat result fields (``mean_ttft_ms``,
``p99_e2el_ms``...) next to ours in every phase."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from aphrodite_cli.bench.results.stats import percentile
from engine.errors import ConfigError

#: vLLM's metric names -> the sample list of a phase that holds them (ms); ``ttst`` (time to
#: second token) is AIPerf's, given vLLM's field shape (``p99_ttst_ms``).
METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms",
           "ttst": "ttst_ms"}
#: vLLM names ``e2el``; ours is ``e2e``: both are accepted wherever a metric is named.
ALIASES = {"e2e": "e2el"}


def parse_goodput(parts: list[str]) -> dict[str, float]:
    """SLOs in ms from ``ttft:500 tpot:50`` (vLLM: space-separated values) or
    ``ttft:500,tpot:50`` (ours), in any mix; ``e2el`` and ``e2e`` name the same metric.
    Returns our names (ttft, tpot, e2e)."""
    slos: dict[str, float] = {}
    for item in (p for part in parts for p in re.split(r"[,\s]+", part) if p):
        name, _, value = item.partition(":")
        name = name.strip().lower()
        name = {"e2el": "e2e"}.get(name, name)
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in ("ttft", "tpot", "e2e") or ms <= 0:
            raise ConfigError(f"--goodput {item!r} should look like ttft:500 (metrics ttft, "
                              "tpot, e2el; positive milliseconds)", code="invalid_flag")
        slos[name] = ms
    return slos


def parse_list(flag: str, text: str, allowed: set[str] | None = None) -> list[str]:
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    items = [ALIASES.get(t, t) for t in items]
    bad = [t for t in items if allowed is not None and t not in allowed]
    if not items or bad:
        raise ConfigError(f"{flag} {text!r}: expected a comma-separated list of "
                          f"{', '.join(sorted(allowed or []))}", code="invalid_flag")
    return items


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v <= 100 for v in values):
        raise ConfigError(f"--metric-percentiles {text!r}: expected numbers in (0, 100], "
                          "e.g. 50,90,99", code="invalid_flag")
    return values


def flat_fields(phase: dict[str, Any], metrics: list[str], percentiles: list[float]
                ) -> dict[str, float | None]:
    """vLLM's result fields for one phase: ``mean_/median_/std_{metric}_ms`` and
    ``p{N}_{metric}_ms`` for the chosen metrics and percentiles, plus its totals."""
    out: dict[str, float | None] = {
        "completed": phase["completed"], "request_throughput": phase["request_throughput"],
        "output_throughput": phase["output_throughput"],
        "total_output_tokens": phase["total_output_tokens"],
        "total_input_tokens": phase["total_input_tokens"],
        "total_token_throughput": phase["total_token_throughput"]}
    for metric in metrics:
        summary, samples = phase[METRICS[metric]], phase["samples"].get(METRICS[metric], [])
        out[f"mean_{metric}_ms"] = summary.get("mean")
        out[f"median_{metric}_ms"] = summary.get("median")
        # vLLM's std is numpy's (population, ddof=0); ours elsewhere is the sample std
        out[f"std_{metric}_ms"] = float(np.std(samples)) if samples else None
        for p in percentiles:
            out[f"p{p:g}_{metric}_ms"] = percentile(samples, p) if samples else None
    return out


def load_tokenizer(name: str) -> Any:
    """``--tokenizer``: a folder or hub id, loaded with transformers."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # a hostile folder's files raise anything
        # (a tokenizer.json of the wrong shape is a KeyError deep in transformers)
        raise ConfigError(f"--tokenizer {name!r} could not be loaded ({type(exc).__name__})",
                          hint="pass a tokenizer folder or a Hugging Face Hub id",
                          code="invalid_flag") from None


def count_tokens(tokenizer: Any, records: list) -> None:
    """Output tokens of the answers whose server reported no usage, counted on their text."""
    for r in records:
        if r.ok and not r.usage_reported:
            r.output_tokens = len(tokenizer("".join(r.text), add_special_tokens=False)
                                  ["input_ids"])
            r.token_source = "tokenizer"
