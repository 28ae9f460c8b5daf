"""``bench serve``'s console output beyond the phase table: cache resets, the server's own
counts (``/metrics``), probes, the per-kind and per-modality breakdown, time slices and
warnings. With ``--output-format json`` stdout carries the phase table's JSON alone, so these
go as lines to stderr (everything is in the result file)."""

from __future__ import annotations

from typing import Any

from aphrodite_cli.output import print_table


def _p(stats: dict[str, Any] | None, key: str) -> str:
    value = (stats or {}).get(key)
    return "-" if value is None else f"{value:.1f}"


def _group_rows(groups: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, g in groups.items():
        mm = g.get("mm_tokens") or {}
        per = mm.get("per_request") or {}
        tokens = ", ".join(f"{m} {s.get('mean', 0):.0f}" for m, s in per.items()) or (
            "none" if mm.get("requests_with_counts") else "unknown")
        total = g.get("total_token_throughput")
        rows.append([name, f"{g['completed']}/{g['failed']}",
                     f"{g['request_throughput']:.2f}", f"{g['output_throughput']:.1f}",
                     "-" if total is None else f"{total:.1f}",
                     f"{_p(g['ttft_ms'], 'p50')}/{_p(g['ttft_ms'], 'p99')}",
                     f"{_p(g.get('ttst_ms'), 'p50')}/{_p(g.get('ttst_ms'), 'p99')}",
                     f"{_p(g['tpot_ms'], 'p50')}/{_p(g['tpot_ms'], 'p99')}",
                     f"{_p(g['e2e_ms'], 'p50')}/{_p(g['e2e_ms'], 'p99')}", tokens])
    return rows


def print_phase_extras(doc: dict[str, Any], fmt: str, say: Any) -> None:
    tables = fmt != "json"
    for mode, phase in doc["phases"].items():
        reset = phase.get("cache_reset")
        if reset:
            from aphrodite_cli.bench.load.cache_reset import describe

            say.print(f"{mode}: cache reset before the phase: {describe(reset)}",
                      markup=False)
        metrics = phase.get("server_metrics")
        if metrics is not None:
            if not metrics.get("available"):
                say.print(f"{mode}: server /metrics unavailable ({metrics.get('reason')})",
                          markup=False)
            else:
                cache = metrics.get("processor_cache")
                say.print(f"{mode}: server /metrics: {len(metrics['deltas'])} counters moved"
                          + (f"; processor cache {cache['hits']:g} hits, "
                             f"{cache['misses']:g} misses ({metrics['check']})"
                             if cache else ""), markup=False)
        cpu = phase.get("server_cpu")
        if cpu is not None:
            from aphrodite_cli.bench.results.serve_text import describe

            say.print(f"{mode}: {describe(cpu)}", markup=False)
        probes = phase.get("probes")
        if probes and tables:
            print_table(f"{mode}: probes (text only, {probes['request_rate']:g}/s)",
                        ["sent", "ok/failed", "TTFT p50/p99 ms", "E2E p50/p99 ms"],
                        [[str(probes["sent"]), f"{probes['completed']}/{probes['failed']}",
                          f"{_p(probes['ttft_ms'], 'p50')}/{_p(probes['ttft_ms'], 'p99')}",
                          f"{_p(probes['e2e_ms'], 'p50')}/{_p(probes['e2e_ms'], 'p99')}"]],
                        fmt)
        columns = ["ok/failed", "req/s", "out tok/s", "total tok/s", "TTFT p50/p99 ms",
                   "TTST p50/p99 ms", "TPOT p50/p99 ms",
                   "E2E p50/p99 ms", "media tokens/req"]
        if phase.get("by_kind") and tables:
            print_table(f"{mode}: per kind", ["kind", *columns],
                        _group_rows(phase["by_kind"]), fmt)
        if len(phase.get("by_modality") or {}) > 1 and tables:
            print_table(f"{mode}: per modality", ["modality", *columns],
                        _group_rows(phase["by_modality"]), fmt)
        slices = phase.get("slices")
        if slices and slices["intervals"] and tables:
            print_table(f"{mode}: every {slices['seconds']:g} s (by end time)",
                        ["from s", "ok", "failed", "req/s", "TTFT p50/p99 ms",
                         "TPOT p50/p99 ms"],
                        [[f"{s['start_s']:.1f}", str(s["completed"]), str(s["failed"]),
                          f"{s['rps']:.2f}",
                          f"{_p(s['ttft_ms'], 'p50')}/{_p(s['ttft_ms'], 'p99')}",
                          f"{_p(s['tpot_ms'], 'p50')}/{_p(s['tpot_ms'], 'p99')}"]
                         for s in slices["intervals"]], fmt)
        turns = [(p or {}).get("per_turn") for p in phase.get("per_run") or []]
        turns = [(f"{mode} run {k} of {len(turns)}", t) for k, t in enumerate(turns, 1)
                 if t] if len(turns) > 1 else [(mode, phase.get("per_turn"))]
        for label, section in turns if tables else ():
            from aphrodite_cli.bench.results.serve_text import TURN_COLUMNS, turn_rows, turn_title

            if section:
                print_table(turn_title(label, section), TURN_COLUMNS, turn_rows(section), fmt)
        ci = phase.get("ci95")
        if ci and tables:
            print_table(f"{mode}: over {len(phase.get('runs') or [])} runs (95% interval of "
                        "the mean, Student t)", ["metric", "mean", "95% CI"],
                        [[name, "-" if c["mean"] is None else f"{c['mean']:.4g}",
                          "-" if c["low"] is None else f"[{c['low']:.4g}, {c['high']:.4g}]"]
                         for name, c in ci.items()], fmt)
        for warning in phase.get("warnings") or []:
            say.print(f"{mode}: warning: {warning}", markup=False)
