"""``aphrodite bench gate`` and ``report``: verdicts and reports from result files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.options import (
    OutputFormat,
)
from aphrodite_cli.output import out

#: ``aphrodite bench gate --help``'s epilog.
GATE_EXAMPLES = """Examples:

  aphrodite bench gate --baseline results/baselines/serve-tiny.json --candidate results/serve-*.json

  aphrodite bench gate --baseline base1.json --baseline base2.json --candidate new1.json
  --candidate new2.json --threshold ttft_ms:10%,e2e_ms:5%

Serve results are judged per request on ttft_ms, tpot_ms, e2e_ms, ttst_ms (time to second
token) and output_token_throughput_per_user (higher is better: a drop regresses); --num-runs
results also on run-level throughputs (request, output, total and input tokens/s).

Sweeps (bench sweep with --slo) are compared on capacity: a drop of more than the threshold
(--threshold capacity:10%) is a regression.

Exit status: 1 when a metric regressed beyond its threshold with 95% confidence, else 0."""


def gate(
    baseline: Annotated[list[Path], typer.Option(help="Baseline result file(s); repeat.")],
    candidate: Annotated[list[Path], typer.Option(help="Candidate result file(s); repeat.")],
    threshold: Annotated[str | None, typer.Option(
        help="Per-metric thresholds, e.g. ttft_ms:10%,e2e_ms:5% (default 5%).")] = None,
    markdown_out: Annotated[Path | None, typer.Option(
        "--markdown", help="Also write the verdict table to this file.")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        help="markdown (the verdict table; also for table) or json (for scripts).")
    ] = "markdown",
) -> None:
    """Decide whether a candidate run regressed against a baseline, with noise in mind."""
    from aphrodite_cli.bench.results import gate as g

    if all(g.is_sweep(p) for p in [*baseline, *candidate]):
        limits = g.parse_thresholds(threshold)
        capacity = g.compare_capacity(baseline, candidate,
                                      limits.get("capacity", g.DEFAULT_THRESHOLD))
        table = g.capacity_markdown(capacity)
        out.print(table, markup=False)
        if markdown_out:
            markdown_out.write_text(table + "\n")
        regressed = [v for v in capacity if v["regressed"]]
        out.print(f"\n{'REGRESSION' if regressed else 'PASS'}: capacity dropped in "
                  f"{len(regressed)} of {len(capacity)} phases", markup=False)
        raise typer.Exit(1 if regressed else 0)
    from aphrodite_cli.bench.results import runs

    verdicts = g.compare(baseline, candidate, g.parse_thresholds(threshold))
    table = g.markdown(verdicts)
    regressed: list = [v for v in verdicts if v.regressed]
    # files of bench serve --num-runs N on both sides: the run-level intervals too
    run_verdicts = runs.compare(baseline, candidate, g.parse_thresholds(threshold),
                                g.DEFAULT_THRESHOLD)
    if run_verdicts:
        table += "\n\n" + runs.markdown(run_verdicts)
        regressed += [v for v in run_verdicts if v["regressed"]]
    if output_format == "json":
        from aphrodite_cli.output import print_json

        print_json({"verdicts": g.verdicts_json(verdicts), "run_verdicts": run_verdicts,
                    "regressed": len(regressed)})
        if markdown_out:
            markdown_out.write_text(table + "\n")
        raise typer.Exit(1 if regressed else 0)
    out.print(table, markup=False)
    if markdown_out:
        markdown_out.write_text(table + "\n")
    out.print(f"\n{'REGRESSION' if regressed else 'PASS'}: {len(regressed)} of "
              f"{len(verdicts) + len(run_verdicts)} metrics regressed", markup=False)
    raise typer.Exit(1 if regressed else 0)


#: ``aphrodite bench report --help``'s epilog.
REPORT_EXAMPLES = """Examples:

  aphrodite bench report results/serve-*.json results/mm-processor-*.json \\
      results/video-decode-*.json --out-dir results/report

  aphrodite bench report --baseline results/serve-A.json --candidate results/serve-B.json"""


def report(
    results: Annotated[list[Path] | None, typer.Argument(help="Result JSON files.")] = None,
    baseline: Annotated[list[Path] | None, typer.Option(
        help="A side of an A vs B comparison (serve results; repeat for several runs).")
    ] = None,
    candidate: Annotated[list[Path] | None, typer.Option(
        help="B side: the report opens with the gate's verdict and both sides' CDFs.")
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out-dir")] = None,
) -> None:
    """Plots, a self-contained HTML report and a Markdown summary for pull requests."""
    from aphrodite_cli.bench.results.report import write_report
    from engine.errors import ConfigError

    if bool(baseline) != bool(candidate):
        raise ConfigError("an A vs B report needs both --baseline and --candidate",
                          code="invalid_flag")
    files = list(results or []) + [p for p in [*(baseline or []), *(candidate or [])]
                                   if p not in (results or [])]
    if not files:
        raise ConfigError("pass result files, or --baseline and --candidate",
                          code="invalid_flag")
    html_path, md_path = write_report(files, out_dir, baseline=baseline, candidate=candidate)
    out.print(f"markdown summary: {md_path}", markup=False)
    out.print(f"report: {html_path}", markup=False)
