"""A serve result's telemetry (``--metrics-interval``, see
:mod:`~aphrodite_cli.bench.load.telemetry`) in the report: a table per phase (each gauge's
mean and peak, each counter's rate; each GPU's utilisation, memory and NVDEC use) and a plot
over time. Results without telemetry show nothing here."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.fields import COUNTERS


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _rate(samples: list[dict[str, float]], name: str) -> float | None:
    points = [(s["t_s"], s[name]) for s in samples if s.get(name) is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _gauge(values: list[float]) -> str:
    return f"{_fmt(sum(values) / len(values))} / {_fmt(max(values))}" if values else "-"


def telemetry_markdown(phase: str, telemetry: dict[str, Any] | None) -> list[str]:
    """Markdown lines for one phase's telemetry (none when it has none)."""
    if not telemetry:
        return []
    metrics, gpu = telemetry.get("metrics") or {}, telemetry.get("gpu") or {}
    lines = [f"**{phase}: telemetry every {telemetry.get('interval_s', 0):g} s**", ""]
    samples = metrics.get("samples") or []
    if not metrics.get("available"):
        lines.append(f"- server /metrics: unavailable ({metrics.get('reason')})")
    else:
        names = sorted({k for s in samples for k in s} - {"t_s"})
        lines += [f"{len(samples)} scrapes over {_fmt(samples[-1]['t_s'])} s", "",
                  "| series | mean / peak | rate /s |", "|---|---|---|"]
        for name in names:
            values = [s[name] for s in samples if s.get(name) is not None]
            lines.append(f"| {name} | {'-' if name in COUNTERS else _gauge(values)} | "
                         f"{_fmt(_rate(samples, name)) if name in COUNTERS else '-'} |")
    lines.append("")
    if not gpu.get("available"):
        lines += [f"- GPU: not sampled ({gpu.get('reason')})", ""]
        return lines
    lines += ["| GPU | util % mean / peak | memory used GB peak | NVDEC % mean / peak | "
              "NVENC % mean / peak |", "|---|---|---|---|---|"]
    for device in gpu.get("devices") or []:
        rows = [g for s in gpu.get("samples") or [] for g in s.get("gpus") or []
                if g.get("index") == device.get("index")]

        def of(key: str, rows: list[dict[str, Any]] = rows) -> list[float]:
            return [r[key] for r in rows if r.get(key) is not None]

        used = of("memory_used_bytes")
        lines.append(f"| {device.get('index')}: {device.get('name')} | "
                     f"{_gauge(of('gpu_util_pct'))} | "
                     f"{_fmt(max(used) / 1e9) if used else '-'} | "
                     f"{_gauge(of('decoder_util_pct'))} | {_gauge(of('encoder_util_pct'))} |")
    return [*lines, ""]


def telemetry_plot(path: Path, doc: dict[str, Any], plt: Any, png: Any
                   ) -> list[tuple[str, bytes]]:
    """Requests running and waiting, token rates and GPU use over each phase's time."""
    phases = {p: r["telemetry"] for p, r in (doc.get("phases") or {}).items()
              if ((r.get("telemetry") or {}).get("metrics") or {}).get("samples")}
    if not phases:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for phase, t in phases.items():
        samples = t["metrics"]["samples"]
        for name, style in (("num_requests_running", "-"), ("num_requests_waiting", "--")):
            points = [(s["t_s"], s[name]) for s in samples if s.get(name) is not None]
            if points:
                axes[0].plot(*zip(*points, strict=True), style, label=f"{phase} {name[13:]}")
        for name, style in (("prompt_tokens", "-"), ("generation_tokens", "--")):
            points = [(b["t_s"], (b[name] - a[name]) / (b["t_s"] - a["t_s"]))
                      for a, b in itertools.pairwise(samples)
                      if a.get(name) is not None and b.get(name) is not None
                      and b["t_s"] > a["t_s"]]
            if points:
                axes[1].plot(*zip(*points, strict=True), style, label=f"{phase} {name}/s")
        for s_key, style in (("gpu_util_pct", "-"), ("decoder_util_pct", ":")):
            points = [(s["t_s"], g[s_key]) for s in t["gpu"].get("samples") or []
                      for g in s.get("gpus") or [] if g.get(s_key) is not None]
            if points:
                axes[2].plot(*zip(*points, strict=True), style, label=f"{phase} {s_key[:-4]}")
    for ax, label in zip(axes, ("requests", "tokens/s", "GPU %"), strict=True):
        ax.set_xlabel("seconds into the phase")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Server telemetry (--metrics-interval)")
    return [(f"{path.stem}: telemetry", png(fig))]
