"""``bench report`` of a ``bench sweep serve`` summary: the Pareto plot (output tokens/s per
user against total tokens/s, every combination a point, the front marked and joined) and the
table of combinations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.fields import label


def _name(run: dict[str, Any]) -> str:
    return f"{label(run['serve_params'])} | {label(run['bench_params'])}"


def sweep_serve_plots(path: Path, doc: dict[str, Any], plt: Any,
                      png: Callable[[Any], bytes]) -> list[tuple[str, bytes]]:
    """One Pareto plot per phase that has points with both values."""
    out = []
    runs = doc["runs"]
    for phase in sorted({p for r in runs for p in r["phases"]}):
        points = [(r, r["phases"][phase]) for r in runs if phase in r["phases"]]
        points = [(r, p) for r, p in points if p.get("total_token_throughput") is not None
                  and p.get("output_token_throughput_per_user") is not None]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = [p["total_token_throughput"] for _, p in points]
        ys = [p["output_token_throughput_per_user"] for _, p in points]
        ax.scatter(xs, ys, s=28, color="#888", label="combination")
        front = sorted((p["total_token_throughput"], p["output_token_throughput_per_user"])
                       for _, p in points if p.get("pareto"))
        if front:
            ax.plot([x for x, _ in front], [y for _, y in front], "-o", color="#c33",
                    markersize=8, label="Pareto front")
        for run, p in points:
            ax.annotate(_name(run), (p["total_token_throughput"],
                                     p["output_token_throughput_per_user"]),
                        fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("total tokens/s (input + output, all users)")
        ax.set_ylabel("output tokens/s per user (median)")
        ax.set_title(f"{phase} phase: per-user speed against total throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out.append((f"{path.stem}: Pareto front ({phase})", png(fig)))
    return out


def sweep_serve_markdown(doc: dict[str, Any]) -> list[str]:
    """The combinations as a Markdown table, front members marked."""

    def num(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"server: `{doc.get('serve_cmd')}`, bench: `{doc.get('bench_cmd')}`", "",
             "| server params | bench params | phase | ok/failed | total tok/s | "
             "out tok/s/user p50 | TTFT p50 ms | Pareto | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        for phase, p in run["phases"].items():
            lines.append(f"| {label(run['serve_params'])} | {label(run['bench_params'])} | "
                         f"{phase} | {p.get('completed')}/{p.get('failed')} | "
                         f"{num(p.get('total_token_throughput'))} | "
                         f"{num(p.get('output_token_throughput_per_user'))} | "
                         f"{num(p.get('ttft_ms_median'))} | "
                         f"{'yes' if p.get('pareto') else ''} | {run['result']} |")
    return lines
