"""``aphrodite bench sweep serve``: server flags against the same load (vLLM's names)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.bench.commands import flags
from aphrodite_cli.output import err, out, print_table

#: ``aphrodite bench sweep serve --help``'s epilog.
EXAMPLES = """Examples:

  aphrodite bench sweep serve --serve-params '[{"max_num_seqs": 4}, {"max_num_seqs": 16}]'
  --bench-params '[{"max_concurrency": 4}, {"max_concurrency": 16}]'
  --bench-cmd 'aphrodite bench serve --num-prompts 40 --mode cold'

  aphrodite bench sweep serve --serve-cmd 'vllm serve Qwen/Qwen2.5-VL-3B-Instruct --port {port}'
  --serve-params serve_params.json --bench-params bench_params.json -o results/

Each parameter set is a JSON object of flags ({"max_num_seqs": 8} is --max-num-seqs 8; true
is the bare flag, false its --no- form); a list, or a file holding one. Every serve set starts
one server, the bench command runs once per bench set against it. Results: one serve result
per combination, a summary (kind sweep-serve) and, from `bench report SUMMARY`, the Pareto
plot of output tokens/s per user against total tokens/s."""


def sweep_serve_cmd(
    serve_params: Annotated[str | None, typer.Option(
        help="Server flag sets: a JSON list of objects, or a file holding one (vLLM's "
             "--serve-params); default: one server as the command gives it.")] = None,
    bench_params: Annotated[str | None, typer.Option(
        help="bench serve flag sets, run against every server (the Cartesian product; vLLM's "
             "--bench-params); default: the bench command as given.")] = None,
    serve_cmd: Annotated[str | None, typer.Option(
        help="The server's command with {port} where its port goes, e.g. 'vllm serve M "
             "--port {port}' (ready when GET /v1/models answers); default: the embedded "
             "aphrodite serve (the tiny model, or --model).")] = None,
    bench_cmd: Annotated[str, typer.Option(
        help="The aphrodite bench serve command each run starts from; the sweep adds the "
             "target, --model, --out-dir and --result-filename.")] = "aphrodite bench serve",
    model: Annotated[str | None, typer.Option(
        help="The model the embedded server serves (default: the tiny one), and the name "
             "requests carry (default: the first of the server's GET /v1/models).")] = None,
    out_dir: Annotated[Path, typer.Option(
        "--out-dir", "--output-dir", "-o",
        help="The sweep writes into a sweep-serve-<UTC time> folder under this one.")
    ] = Path("results"),
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print each server and bench command, run nothing.")] = False,
    server_ready_timeout: Annotated[float, typer.Option(
        min=1, help="Seconds a server may take to answer GET /v1/models.")] = 300.0,
    output_format: flags.OutputFormat = "table",
) -> None:
    """Server flags against the same load: one server per --serve-params set, every
    --bench-params set against it; results, a summary and a Pareto front."""
    from aphrodite_cli.bench.load import sweep_serve as ss
    from aphrodite_cli.bench.load.sweep_params import parse_params
    from aphrodite_cli.bench.results.escape import printable
    from aphrodite_cli.bench.results.fields import label
    from aphrodite_cli.bench.results.files import write_result

    say = err if output_format == "json" else out
    folder = out_dir / f"sweep-serve-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    settings = ss.SweepServeSettings(
        serve_params=parse_params(serve_params, "--serve-params", reserved=ss.SERVE_RESERVED),
        bench_params=parse_params(bench_params, "--bench-params", reserved=ss.BENCH_RESERVED),
        folder=folder, serve_cmd=serve_cmd, bench_cmd=bench_cmd, model=model,
        ready_timeout_s=server_ready_timeout)
    if serve_cmd:
        from aphrodite_cli.bench.harness.command_server import command_argv

        command_argv(serve_cmd, 0, [])  # a template without {port}: refused before anything
    ss.bench_argv(bench_cmd, "URL", "MODEL", folder, "x.json", {})  # likewise a bad one
    if dry_run:
        for i, serve in enumerate(settings.serve_params):
            say.print(f"server #{i}: {' '.join(ss.server_argv(settings, serve))}", markup=False)
            for j, bench in enumerate(settings.bench_params):
                argv = ss.bench_argv(bench_cmd, "http://127.0.0.1:{port}", model or "MODEL",
                                     folder, f"serve-s{i}-b{j}.json", bench)
                say.print(f"  bench #{j}: {' '.join(argv)}", markup=False)
        return
    summary = ss.run_sweep(settings, lambda line: say.print(printable(line), markup=False))
    path = write_result(summary, "sweep-serve", folder, filename="summary.json")

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print_table("bench sweep serve: every combination",
                ["server", "bench", "phase", "ok/failed", "total tok/s",
                 "out tok/s/user p50", "TTFT p50 ms", "Pareto"],
                [[label(r["serve_params"]), label(r["bench_params"]), phase,
                  f"{p['completed']}/{p['failed']}", num(p["total_token_throughput"]),
                  num(p["output_token_throughput_per_user"]), num(p["ttft_ms_median"]),
                  "yes" if p["pareto"] else ""]
                 for r in summary["runs"] for phase, p in r["phases"].items()], output_format)
    say.print(f"summary: {path} (bench report {path} draws the Pareto front)", markup=False)
    ss.failures(summary)
