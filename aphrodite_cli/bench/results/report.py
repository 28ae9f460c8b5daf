"""`aphrodite bench report`: plots, a self-contained HTML report and a Markdown summary from
result files. Every output reads the same result documents the gate reads."""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.escape import markdown_safe as _md
from aphrodite_cli.bench.results.escape import printable
from aphrodite_cli.bench.results.fields import stage_ms
from aphrodite_cli.bench.results.report_serve_extras import serve_markdown, serve_plots
from aphrodite_cli.bench.results.report_sweep_serve import (
    sweep_serve_markdown,
    sweep_serve_plots,
)
from engine.errors import ConfigError
from engine.timings import SERVED_STAGES as STAGES


def _load(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    from aphrodite_cli.bench.results.files import load_result

    return [(path, load_result(path)) for path in paths]


def _cdf(ax, samples: list[float], label: str) -> bool:
    """An empirical CDF as a step function starting at 0; False when there is nothing."""
    import numpy as np

    values = np.sort(np.asarray(samples, dtype=float))
    if not values.size:
        return False
    ax.step(np.concatenate([[values[0]], values]),
            np.concatenate([[0.0], np.arange(1, values.size + 1) / values.size]),
            where="post", label=label)
    ax.set_ylim(0, 1.02)
    return True


def _pyplot():
    """matplotlib's pyplot, off screen, with text drawn as it is written: a phase, backend or
    file name from a result file is never read as mathtext (``$...$``, which a stray ``$``
    turns into a parse error) or handed to LaTeX."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"text.parse_math": False, "text.usetex": False})
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def plots(docs: list[tuple[Path, dict[str, Any]]]) -> list[tuple[str, bytes]]:
    """(title, PNG) for every plot the results support."""
    import numpy as np

    plt = _pyplot()
    out: list[tuple[str, bytes]] = []
    for path, doc in docs:
        with _named(path):
            out += _doc_plots(path, doc, plt, np)
    sweeps = [(path, doc) for path, doc in docs if doc.get("kind") == "sweep"]
    if sweeps:
        with _named(", ".join(str(p) for p, _ in sweeps)):
            out += _sweep_plots(sweeps, plt)
    return out


def _doc_plots(path: Path, doc: dict[str, Any], plt, np) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    kind, name = doc.get("kind"), path.stem
    phases = doc.get("phases") or {}
    if kind == "serve":
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, metric in zip(axes, ("ttft_ms", "e2e_ms"), strict=True):
            for phase, result in phases.items():
                _cdf(ax, result.get("samples", {}).get(metric, []), phase)
            ax.set_xlabel(f"{metric[:-3].upper()} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle("Cold media vs warm cache: latency distributions")
        out.append((f"{name}: cold vs warm latency", _png(fig)))
        fig, ax = plt.subplots(figsize=(7, 3.6))
        bottom = np.zeros(len(phases))
        for stage in STAGES:
            medians = [float(np.median(r.get("samples", {}).get("stages_ms", {})
                                       .get(stage_ms(stage), [0]) or [0]))
                       for r in phases.values()]
            ax.bar(list(phases), medians, bottom=bottom, label=stage[:-2])
            bottom += np.array(medians)
        ax.set_ylabel("median ms per request")
        ax.set_title("Server-side stages per request")
        ax.legend(fontsize=8, ncol=2)
        out.append((f"{name}: per-stage breakdown", _png(fig)))
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for phase, result in phases.items():
            s = result.get("samples", {})
            if s.get("pixels") and s.get("e2e_ms"):
                ax.scatter(np.array(s["pixels"]) / 1e6, s["e2e_ms"], s=12, label=phase)
        ax.set_xlabel("megapixels per request (frames x width x height)")
        ax.set_ylabel("E2E (ms)")
        ax.set_title("Latency against media size")
        ax.legend()
        out.append((f"{name}: latency vs pixels", _png(fig)))
        out += serve_plots(path, doc, plt, _png)
    elif kind == "video-decode":
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = [b["backend"] + ("" if not b["options"] else " " + ",".join(
            f"{k}={v}" for k, v in b["options"].items())) for b in doc["backends"]]
        medians = [b["median_s"] or 0 for b in doc["backends"]]
        ax.barh(labels, medians, color="#4a7")
        ref = doc["reference"]["median_s"]
        if ref:
            ax.axvline(ref, color="red", linestyle="--", label="full ffmpeg decode")
            ax.legend()
        clip = doc["clip"]
        ax.set_xlabel("seconds per decode (median)")
        ax.set_title(f"{doc['num_frames']} frames from {clip['width']}x{clip['height']} "
                     f"{clip['codec']} ({clip['frames']} frames)")
        out.append((f"{name}: decode time per backend", _png(fig)))
    elif kind == "sweep-serve":
        out += sweep_serve_plots(path, doc, plt, _png)
    elif kind == "mm-processor":
        fig, ax = plt.subplots(figsize=(7, 3.2))
        data = [r.get("samples", {}).get("total_ms", []) for r in phases.values()]
        if any(data):
            ax.boxplot(data, tick_labels=list(phases), vert=False)
            ax.set_xscale("log")
            ax.set_xlabel("preprocessing ms per request (log)")
            ax.set_title("Preprocessing: cold vs warm")
            out.append((f"{name}: preprocessing cold vs warm", _png(fig)))
        else:
            plt.close(fig)
    return out


def _offered_order(point: dict[str, Any]) -> float:
    if point["kind"] == "synchronous":
        return 0.0
    if point["kind"] == "saturation" or not point.get("offered_rate"):
        return math.inf
    return float(point["offered_rate"])


def _sweep_plots(sweeps: list[tuple[Path, dict[str, Any]]], plt) -> list[tuple[str, bytes]]:
    """Latency (p50/p90/p99 of TTFT, TPOT, E2E) against the served rate, every sweep and
    phase overlaid (A vs B), with the SLO limits as lines and each capacity marked."""
    out = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
        if not any((p["result"].get(metric) or {}).get("p50") is not None for _, doc in sweeps
                   for r in doc["phases"].values() for p in r["points"]):
            ax.set_visible(False)  # the target reported nothing for it (e.g. 1-token answers)
            continue
        for path, doc in sweeps:
            for phase, result in doc["phases"].items():
                # in the order of the load offered (one at a time first, all at once last):
                # past saturation the served rate falls back while latency climbs, and the
                # curve hooks back instead of zig-zagging between points
                points = sorted((p for p in result["points"] if p.get("served_rate")
                                 and p["kind"] != "saturation"), key=_offered_order)
                burst = [p for p in result["points"] if p["kind"] == "saturation"
                         and p.get("served_rate")]  # all at once: a marker, not on the curve
                for pct, style in (("p50", ":"), ("p90", "--"), ("p99", "-")):
                    xs = [p["served_rate"] for p in points
                          if (p["result"].get(metric) or {}).get(pct) is not None]
                    ys = [p["result"][metric][pct] for p in points
                          if (p["result"].get(metric) or {}).get(pct) is not None]
                    if xs:
                        line = ax.plot(xs, ys, style, marker="o", markersize=3,
                                       label=f"{path.stem} {phase} {pct}")[0]
                        for p in burst:
                            if (p["result"].get(metric) or {}).get(pct) is not None:
                                ax.plot([p["served_rate"]], [p["result"][metric][pct]], "x",
                                        color=line.get_color())
                cap = (result.get("capacity") or {}).get("rate")
                if cap:
                    ax.axvline(cap, color="green", alpha=0.5)
            for slo in doc.get("slos", []):
                name, _, rest = slo.partition(" ")
                if f"{name}_ms" == metric:
                    ax.axhline(float(rest.split("<=")[1].split()[0]), color="red",
                               linestyle="--", alpha=0.6)
        ax.set_xlabel("served requests/s")
        ax.set_ylabel(f"{metric[:-3].upper()} (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle("Latency against load (red: SLO limits; green: capacity; x: all at once)")
    out.append(("sweep: latency against served rate", _png(fig)))
    return out


def _serve_header(doc: dict[str, Any]) -> str:
    """What a published number needs next to it: target, model, dataset, load, phases, date."""
    config, target = doc.get("config") or {}, doc.get("target") or {}
    rate = config.get("request_rate", "inf")
    # the target's words (its model id) and the user's (the URL), as text, never Markdown
    return (f"Target {_md(target.get('base_url') or config.get('base_url') or '?')}"
            f"{_md(target.get('endpoint') or '')}, model "
            f"{_md(config.get('model') or '?')}, dataset "
            f"{_md(doc.get('dataset', '?'))} ({_md(doc.get('num_prompts', '?'))} prompts per "
            f"phase), rate {_md(rate)}/s, concurrency "
            f"{_md(config.get('max_concurrency') or 'unlimited')}, phases "
            f"{', '.join(_md(p) for p in doc.get('phases') or {})}, run "
            f"{_md(doc.get('created_utc', '?'))}.")


def comparison(baseline: list[Path], candidate: list[Path]
               ) -> tuple[str, list[tuple[str, bytes]]]:
    """A vs B: the gate's verdict table and one line per metric, and the latency CDFs of
    both overlaid per phase."""
    from aphrodite_cli.bench.results import gate, runs
    from aphrodite_cli.bench.results.files import load_result

    plt = _pyplot()
    verdicts = gate.compare(baseline, candidate)
    regressed = [v for v in verdicts if v.regressed]
    improved = [v for v in verdicts if v.improved]
    names = lambda paths: ", ".join(_md(p.name) for p in paths)  # noqa: E731
    lines = ["## A vs B", "", f"A (baseline): {names(baseline)}; B (candidate): "
             f"{names(candidate)}.", "",
             f"**Verdict: {'REGRESSION' if regressed else 'PASS'}** ({len(regressed)} of "
             f"{len(verdicts)} metrics slower beyond their threshold with 95% confidence, "
             f"{len(improved)} faster).", "", gate.markdown(verdicts), ""]
    run_verdicts = runs.compare(baseline, candidate, {}, gate.DEFAULT_THRESHOLD)
    if run_verdicts:  # both sides ran with --num-runs N: the run-to-run intervals too
        lines += [runs.markdown(run_verdicts), ""]
    for v in verdicts:
        change = (v.ratio - 1) * 100
        word = ("slower" if v.regressed else "faster" if v.improved else
                "no significant change")
        lines.append(f"- {_md(v.phase)} {v.metric}: B is {change:+.1f}% "
                     f"(95% CI {(v.low - 1) * 100:+.1f}% .. {(v.high - 1) * 100:+.1f}%): {word}")
    docs = {"A": [load_result(p, ("serve",)) for p in baseline],
            "B": [load_result(p, ("serve",)) for p in candidate]}
    phases = sorted({ph for d in docs["A"] + docs["B"] for ph in d.get("phases") or {}})
    images = []
    for phase in phases:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        drawn = False
        for ax, metric in zip(axes, ("ttft_ms", "e2e_ms"), strict=True):
            for side, side_docs in docs.items():
                pooled = [x for d in side_docs for x in ((d.get("phases") or {}).get(phase, {})
                                                          .get("samples", {}).get(metric, []))]
                drawn |= _cdf(ax, pooled, side)
            ax.set_xlabel(f"{metric[:-3].upper()} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"A vs B, {phase} phase")
        if drawn:
            images.append((f"A vs B: {phase} latency", _png(fig)))
        else:
            plt.close(fig)
    return "\n".join(lines), images


def _num(value: Any, spec: str = "") -> str:
    """A number in a table cell; "-" where the result has none."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "?"  # not a number where the kind has one: shown, never formatted
    return format(value, spec)


def summary_markdown(docs: list[tuple[Path, dict[str, Any]]]) -> str:
    lines = ["# aphrodite benchmark report", ""]
    for path, doc in docs:
        with _named(path):
            lines += _section(path, doc)
    return "\n".join(lines)


@contextlib.contextmanager
def _named(path: object) -> Iterator[None]:
    """A field of a result file that its kind's model does not check, of another type or
    shape than the report reads, becomes a one-line error naming the file."""
    try:
        yield
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ConfigError(f"{path} holds a field of another type or shape than its kind's "
                          f"({type(exc).__name__}: {printable(exc, 200)})",
                          hint="pass a file that an aphrodite bench command wrote",
                          code="result_incomplete") from None


def _section(path: Path, doc: dict[str, Any]) -> list[str]:
    """One result file's part of the summary; every name from the file Markdown-escaped."""
    lines: list[str] = []
    kind = doc.get("kind")
    env = doc.get("environment", {})
    lines.append(f"## {_md(path.name)} ({_md(kind)}; git {_md(env.get('git_revision'))}, "
                 f"{_md(env.get('cpu_count'))} CPUs)")
    if kind == "serve":
        lines += [_serve_header(doc), ""]
        lines += ["| phase | ok | failed | cancelled | req/s | in tok/s | out tok/s | "
                  "total tok/s | out tok/s/user p50 | TTFT p50 ms | TTFT p99 ms | "
                  "TTST p50 ms | TPOT p50 ms | E2E p50 ms | cache hit rate | "
                  "prefix hit rate |", "|---" * 16 + "|"]
        for phase, r in doc["phases"].items():
            ttft, tpot, e2e, ttst, user = (r.get(m) or {} for m in (
                "ttft_ms", "tpot_ms", "e2e_ms", "ttst_ms",
                "output_token_throughput_per_user"))
            lines.append(f"| {_md(phase)} | {_num(r.get('completed'))} | "
                         f"{_num(r.get('failed'))} | {_num(r.get('cancelled'))} | "
                         f"{_num(r.get('request_throughput'), '.2f')} | "
                         f"{_num(r.get('input_token_throughput'), '.1f')} | "
                         f"{_num(r.get('output_throughput'), '.1f')} | "
                         f"{_num(r.get('total_token_throughput'), '.1f')} | "
                         f"{_num(user.get('median'), '.1f')} | "
                         f"{_num(ttft.get('median'), '.1f')} | "
                         f"{_num(ttft.get('p99'), '.1f')} | "
                         f"{_num(ttst.get('median'), '.1f')} | "
                         f"{_num(tpot.get('median'), '.2f')} | "
                         f"{_num(e2e.get('median'), '.1f')} | "
                         f"{_num((r.get('server_cache') or {}).get('hit_rate'), '.0%')} | "
                         f"{_num((r.get('prefix_cache') or {}).get('hit_rate'), '.0%')} |")
        lines += ["", *serve_markdown(doc)]
    elif kind == "video-decode":
        lines += ["| backend | options | median s | x full decode | frames exact |",
                  "|---|---|---|---|---|"]
        ref = doc["reference"]["median_s"]
        lines.append(f"| ffmpeg full decode | -threads 2 | {ref:.3f} | 1.00 | |"
                     if ref else "| ffmpeg | not installed | | | |")
        for b in doc["backends"]:
            ratio = b.get("ratio_to_full_decode")
            lines.append(f"| {_md(b['backend'])} | {_md(json.dumps(b['options']))} | "
                         f"{_num(b['median_s'] or 0, '.3f')} | "
                         f"{'' if ratio is None else _num(ratio, '.2f')} | "
                         f"{_md(b['identical_to_exact'])} |")
    elif kind == "batching" and doc.get("workload") == "mixed":
        lines += [f"{_md(doc.get('num_prompts', '?'))} requests, one in "
                  f"{round(1 / doc['long_share']) if doc.get('long_share') else '?'} of "
                  f"{_md(doc.get('long_tokens', '?'))} tokens, the others "
                  f"{_md(doc.get('short_tokens', '?'))}; --max-num-seqs "
                  f"{_md(doc.get('max_num_seqs', '?'))}", "",
                  "| scheduling | output tok/s | req/s | short TTFT p50 ms |",
                  "|---|---|---|---|"]
        for name in ("static", "continuous"):
            r = doc[name]
            ttft = (r.get("short_ttft_s") or {}).get("median")
            lines.append(f"| {name} | {r['output_throughput']['median']:.1f} | "
                         f"{r['request_throughput']['median']:.2f} | "
                         f"{_num(None if ttft is None else ttft * 1e3, '.0f')} |")
        lines += ["", f"continuous / static output throughput: "
                      f"{doc['continuous_over_static_output_throughput']:.2f}x"]
    elif kind == "batching":
        lines += ["| concurrent requests | together s | one after another s | speedup |",
                  "|---|---|---|---|",
                  f"| {doc['concurrency']} | {doc['concurrent_s']['median']:.2f} | "
                  f"{doc['sequential_s']['median']:.2f} | {doc['speedup_median']:.1f}x |"]
    elif kind == "decode-step":
        bw = doc["bandwidth"]["gb_s"]["median"]
        lines += [f"{_md(doc.get('model', '?'))}, {doc['num_threads']} threads, read bandwidth "
                  f"{bw:.1f} GB/s", "",
                  "| weights | batch | context | ms p50 | MB read | floor ms | x floor | "
                  "vs as loaded/eager |", "|---|---|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            ratio = r.get("vs_unquantized") or r.get("vs_eager")
            what = str(r.get("quantization", "none")) if r.get("compiled") is None else \
                ("compiled" if r["compiled"] else "eager")
            lines.append(f"| {_md(what)} | {r['batch_size']} | "
                         f"{r['context_len']} | {r['step_ms']['median']:.2f} | "
                         f"{r['bytes'] / 1e6:.1f} | {r['floor_ms']:.2f} | "
                         f"{r['ratio_to_floor']:.2f} | {_num(ratio, '.2f')} |")
        for method, q in (doc.get("quality") or {}).items():
            lines += ["", f"{_md(str(method))}: top-1 agreement {q['top1_agreement']:.3f}, "
                          f"greedy match {q['greedy_match']:.3f}, mean KL {q['mean_kl']:.2e} "
                          f"nats ({q['prompts']} prompts x {q['tokens_per_prompt']} tokens)"]
    elif kind == "sweep":
        lines += [f"SLOs: {', '.join(_md(x) for x in doc.get('slos') or []) or 'none'}", "",
                  "| phase | capacity req/s | limited by | points | seconds |",
                  "|---|---|---|---|---|"]
        for phase, r in doc["phases"].items():
            cap = r.get("capacity") or {}
            rate = cap.get("rate")
            lines.append(f"| {_md(phase)} | {_num(rate, '.3g')} | "
                         f"{_md(cap.get('limited_by', '-'))} | {len(r['points'])} | "
                         f"{_num(r['seconds'], '.0f')} |")
    elif kind == "sweep-serve":
        lines += sweep_serve_markdown(doc)
    elif kind == "mm-processor":
        lines += ["| phase | median ms | p99 ms | hit rate |", "|---|---|---|---|"]
        for phase, r in doc["phases"].items():
            lines.append(f"| {_md(phase)} | {r['total_s']['median'] * 1e3:.2f} | "
                         f"{r['total_s']['p99'] * 1e3:.2f} | {r['hit_rate']:.0%} |")
        if doc.get("video_backends"):
            lines += ["", "| video backend | clip | decode median ms |", "|---|---|---|"]
            for row in doc["video_backends"]:
                lines.append(f"| {_md(row['backend'])} | {_md(row['clip'])} | "
                             f"{row['decode_ms']['median']:.1f} |")
    lines.append("")
    return lines


def write_report(paths: list[Path], out_dir: Path | None = None, *,
                 baseline: list[Path] | None = None, candidate: list[Path] | None = None
                 ) -> tuple[Path, Path]:
    """The report of ``paths``; with ``baseline`` and ``candidate`` (serve results) it opens
    with their comparison: the gate's verdict and both sides' latency CDFs."""
    docs = _load(paths)
    folder = out_dir or Path("results") / f"report-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    images = plots(docs)
    md = summary_markdown(docs)
    if baseline and candidate:
        compare_md, compare_images = comparison(baseline, candidate)
        md = md.replace("# aphrodite benchmark report\n", "# aphrodite benchmark report\n\n"
                        + compare_md + "\n", 1)
        images = compare_images + images
    for n, (_, png) in enumerate(images):
        (folder / f"plot-{n}.png").write_bytes(png)
    md_path = folder / "summary.md"
    md_path.write_text(md + "\n")
    figures = "\n".join(
        f'<figure><img class="plot" alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>" for title, png in images)
    body = _markdown_tables_to_html(md)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>aphrodite benchmark report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px}}
figure{{margin:1.5em 0}}img.plot{{max-width:100%}}figcaption{{color:#555}}</style></head>
<body data-expected-plots="{len(images)}">
{body}
<h2>Plots</h2>
{figures}
<script>
window.addEventListener("load", () => {{
  const ok = [...document.querySelectorAll("img.plot")].filter(i => i.complete &&
                                                                   i.naturalWidth > 0);
  document.body.setAttribute("data-rendered-plots", String(ok.length));
}});
</script>
</body></html>
"""
    html_path = folder / "report.html"
    html_path.write_text(page)
    return html_path, md_path


def _markdown_tables_to_html(md: str) -> str:
    parts, table = [], []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                table.append(line)
            continue
        if table:
            # cells split at unescaped pipes; Markdown's backslash escapes undone, then HTML's
            rows = [[html.escape(_unescape(c.strip()))
                     for c in re.split(r"(?<!\\)\|", r.strip().removeprefix("|")
                                       .removesuffix("|"))] for r in table]
            head = "".join(f"<th>{c}</th>" for c in rows[0])
            rest = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>"
                           for r in rows[1:])
            parts.append(f"<table><tr>{head}</tr>{rest}</table>")
            table = []
        if line.startswith("# "):
            parts.append(f"<h1>{html.escape(_unescape(line[2:]))}</h1>")
        elif line.startswith("## "):
            parts.append(f"<h2>{html.escape(_unescape(line[3:]))}</h2>")
        elif line.startswith(("- ", "**")):  # notes and captions (serve's extras)
            text = re.sub(r"(?<!\\)\*\*", "", line.removeprefix("- "))
            parts.append(f"<p>{html.escape(_unescape(text))}</p>")
    return "\n".join(parts)


def _unescape(text: str) -> str:
    """Markdown's backslash escapes undone (the text then goes through HTML's escape)."""
    return re.sub(r"\\(.)", r"\1", text)
