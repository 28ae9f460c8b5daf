"""The parts of a ``serve`` result's report beyond the phase table: cache resets and the
server's own counts (``/metrics``), probes, the per-kind and per-modality breakdown, media
tokens, time slices, run-to-run confidence intervals and warnings (Markdown), and the time
slice and probe plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.escape import markdown_safe as _md
from aphrodite_cli.bench.results.report_telemetry import telemetry_markdown, telemetry_plot


def _each_run(phase: str, r: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    """``r[key]`` with its label: the one run's, or with --num-runs each run's (``per_run``,
    labelled "run k of N")."""
    runs = [(p or {}).get(key) for p in r.get("per_run") or [] if isinstance(p, dict)]
    if len(runs) > 1:
        return [(f"{_md(phase)} run {k} of {len(runs)}", section)
                for k, section in enumerate(runs, 1) if section]
    return [(_md(phase), r[key])] if r.get(key) else []

def _n(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "?"  # not a number where one belongs: shown, never formatted
    return format(value, spec)


def _pp(stats: dict[str, Any] | None, spec: str = ".1f") -> str:
    stats = stats or {}
    return f"{_n(stats.get('p50', stats.get('median')), spec)} / {_n(stats.get('p99'), spec)}"


def _groups(title: str, groups: dict[str, Any]) -> list[str]:
    lines = [f"**{title}**", "", f"| {title.split()[-1]} | ok | failed | req/s | out tok/s | "
             "total tok/s | TTFT p50 / p99 ms | TTST p50 / p99 ms | TPOT p50 / p99 ms | "
             "E2E p50 / p99 ms | media tokens per request |", "|---" * 11 + "|"]
    for name, g in groups.items():
        per = (g.get("mm_tokens") or {}).get("per_request") or {}
        mm = g.get("mm_tokens") or {}
        tokens = ", ".join(f"{_md(m)} {_n(s.get('mean', 0), '.0f')}"
                           for m, s in per.items()) or (
            "none" if mm.get("requests_with_counts") else "unknown")
        lines.append(f"| {_md(name)} | {_md(g.get('completed'))} | {_md(g.get('failed'))} | "
                     f"{_n(g.get('request_throughput'), '.2f')} | "
                     f"{_n(g.get('output_throughput'))} | "
                     f"{_n(g.get('total_token_throughput'))} | {_pp(g.get('ttft_ms'))} | "
                     f"{_pp(g.get('ttst_ms'))} | {_pp(g.get('tpot_ms'), '.2f')} | "
                     f"{_pp(g.get('e2e_ms'))} | {tokens} |")
    return [*lines, ""]


def serve_markdown(doc: dict[str, Any]) -> list[str]:
    """Markdown lines for everything a serve result holds beyond the phase table."""
    lines: list[str] = []
    for phase, r in (doc.get("phases") or {}).items():
        part: list[str] = []
        for route, reset in (r.get("cache_reset") or {}).items():
            part.append(f"- cache reset before the phase, {_md(route)}: "
                        f"{_md(reset.get('status'))}"
                        + (f" (HTTP {_md(reset['http'])})" if reset.get("http") not in (None, 200)
                           else ""))
        metrics = r.get("server_metrics")
        if metrics is not None and not metrics.get("available"):
            part.append(f"- server /metrics: unavailable ({_md(metrics.get('reason'))})")
        elif metrics is not None:
            cache = metrics.get("processor_cache")
            part.append(f"- server /metrics: {len(metrics.get('deltas') or {})} counters moved"
                        + (f"; processor cache counted {_n(cache['hits'], 'g')} hits, "
                           f"{_n(cache['misses'], 'g')} misses: {_md(metrics.get('check'))}"
                           if cache
                           else "; no processor cache counter"))
            prefix = metrics.get("prefix_cache")
            if prefix and prefix.get("hit_rate") is not None:
                part.append(f"- server prefix cache hit rate: {_n(prefix['hit_rate'], '.0%')}")
        cpu = r.get("server_cpu")
        if cpu is not None:
            from aphrodite_cli.bench.results.serve_text import describe

            part.append(f"- {_md(describe(cpu))}")
        mm = r.get("mm_tokens")
        if mm:
            rates = ", ".join(f"{_md(k)} {_n(v)}" for k, v in (mm.get("throughput") or {}).items())
            part.append(f"- media tokens: {rates or 'unknown'} (from {_md(mm.get('source'))})")
        for warning in r.get("warnings") or []:
            part.append(f"- **warning**: {_md(warning)}")
        if part:
            lines += [f"**{_md(phase)} phase**", "", *part, ""]
        probes = r.get("probes")
        if probes:
            lines += [f"**{_md(phase)}: probes** (text only, {_md(probes.get('request_rate'))}/s, "
                      "measured apart from the phase)", "",
                      "| sent | ok | failed | TTFT p50 / p99 ms | E2E p50 / p99 ms |",
                      "|---|---|---|---|---|",
                      f"| {_md(probes.get('sent'))} | {_md(probes.get('completed'))} | "
                      f"{_md(probes.get('failed'))} | {_pp(probes.get('ttft_ms'))} | "
                      f"{_pp(probes.get('e2e_ms'))} |", ""]
        if r.get("by_kind"):
            lines += _groups(f"{_md(phase)}: per kind", r["by_kind"])
        if len(r.get("by_modality") or {}) > 1:
            lines += _groups(f"{_md(phase)}: per modality", r["by_modality"])
        for label, section in _each_run(phase, r, "per_turn"):
            from aphrodite_cli.bench.results.serve_text import TURN_COLUMNS, turn_rows, turn_title

            lines += [f"**{turn_title(label, section)}**", "",
                      "| " + " | ".join(TURN_COLUMNS) + " |", "|---" * len(TURN_COLUMNS) + "|",
                      *("| " + " | ".join(row) + " |" for row in turn_rows(section)),
                      ""]
        slices = r.get("slices")
        if slices and slices.get("intervals"):
            lines += [f"**{_md(phase)}: every {_n(slices['seconds'], 'g')} s** (requests by end "
                      "time)", "",
                      "| from s | ok | failed | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {_n(s['start_s'])} | {_md(s['completed'])} | {_md(s['failed'])} | "
                      f"{_n(s['rps'], '.2f')} | {_pp(s.get('ttft_ms'))} | "
                      f"{_pp(s.get('tpot_ms'), '.2f')} |" for s in slices["intervals"]]
            lines.append("")
        for label, section in _each_run(phase, r, "telemetry"):
            lines += telemetry_markdown(label, section)
        ci = r.get("ci95")
        if ci:
            lines += [f"**{_md(phase)}: over {len(r.get('runs') or [])} runs** "
                      f"(95% confidence interval of the mean, {_md(ci_method(ci))})", "",
                      "| metric | mean | 95% CI |", "|---|---|---|"]
            lines += [f"| {_md(name)} | {_n(c.get('mean'), '.3g')} | "
                      f"[{_n(c.get('low'), '.3g')}, {_n(c.get('high'), '.3g')}] |"
                      for name, c in ci.items()]
            lines.append("")
    return lines


def ci_method(ci: dict[str, Any]) -> str:
    return next((c.get("method") for c in ci.values() if c.get("method")), "?")


def serve_plots(path: Path, doc: dict[str, Any], plt: Any, png: Any
                ) -> list[tuple[str, bytes]]:
    """Time slices (served req/s and TTFT p50/p99 per interval) and the probes' TTFT CDF
    against the phase's, per phase."""
    out = []
    phases = doc.get("phases") or {}
    sliced = {p: r["slices"]["intervals"] for p, r in phases.items()
              if (r.get("slices") or {}).get("intervals")}
    if sliced:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for phase, intervals in sliced.items():
            xs = [s["start_s"] for s in intervals]
            axes[0].step(xs, [s["rps"] for s in intervals], where="post", label=phase)
            for pct, style in (("p50", "-"), ("p99", "--")):
                points = [(s["start_s"], s["ttft_ms"][pct]) for s in intervals
                          if s["ttft_ms"].get(pct) is not None]
                if points:
                    axes[1].plot(*zip(*points, strict=True), style, marker="o", markersize=3,
                                 label=f"{phase} {pct}")
        axes[0].set_ylabel("completed requests/s")
        axes[1].set_ylabel("TTFT (ms)")
        for ax in axes:
            ax.set_xlabel("seconds into the phase")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Time slices")
        out.append((f"{path.stem}: time slices", png(fig)))
    turned = {p: r["per_turn"]["turns"] for p, r in phases.items()
              if (r.get("per_turn") or {}).get("turns")}
    if turned:
        out.append((f"{path.stem}: per turn", png(_turn_plot(turned, plt))))
    probed = {p: r for p, r in phases.items() if (r.get("probes") or {}).get("samples")}
    if probed:
        import numpy as np

        fig, ax = plt.subplots(figsize=(7, 3.6))
        for phase, r in probed.items():
            for label, values in ((f"{phase} probes", r["probes"]["samples"].get("ttft_ms")),
                                  (f"{phase} requests", (r.get("samples") or {}).get(
                                      "ttft_ms"))):
                v = np.sort(np.asarray(values or [], dtype=float))
                if v.size:
                    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("Probes (small text requests) against the phase's requests")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append((f"{path.stem}: probe TTFT", png(fig)))
    return out + telemetry_plot(path, doc, plt, png)



def _turn_plot(turned: dict[str, list[dict[str, Any]]], plt: Any) -> Any:
    """TTFT p50/p90 and the prefix cache hit rate per turn index, per phase."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for phase, turns in turned.items():
        for pct, style in (("p50", "-"), ("p90", "--")):
            points = [(t["turn"], t["ttft_ms"][pct]) for t in turns
                      if (t.get("ttft_ms") or {}).get(pct) is not None]
            if points:
                axes[0].plot(*zip(*points, strict=True), style, marker="o", markersize=3,
                             label=f"{phase} {pct}")
        points = [(t["turn"], t["prefix_hit_rate"]) for t in turns
                  if t.get("prefix_hit_rate") is not None]
        if points:
            axes[1].plot(*zip(*points, strict=True), marker="o", markersize=3, label=phase)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("prefix cache hit rate (usage)")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("turn")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Multi-turn sessions per turn")
    return fig
