"""``aphrodite bench sweep serve``: server flags against the same load (vLLM's ``vllm bench sweep
serve``). For each ``--serve-params`` set a server is started once (the embedded ``aphrodite
serve``, or ``--serve-cmd``), the ``bench serve`` command runs once per ``--bench-params`` set
against it (the Cartesian product), and the server is stopped. Each combination's result is
the normal serve result file with the combination recorded (``sweep``); the summary holds one
row per combination and phase and the Pareto front of output tokens/s per user (median)
against total tokens/s, the trade a server flag such as ``--max-num-seqs`` moves along."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.harness.command_server import CommandServer
from aphrodite_cli.bench.harness.server_process import BIN
from aphrodite_cli.bench.load.sweep_params import as_flags, last_error
from aphrodite_cli.bench.load.target import READY_TIMEOUT_S, Target
from aphrodite_cli.bench.results.fields import label
from engine.errors import BenchmarkFailed, ConfigError

#: Flags the sweep sets on each server (its port and process file are the harness's).
SERVE_RESERVED = frozenset({"--port", "--host", "--process-file"})
#: Flags the sweep sets on each ``bench serve`` (the target and where its result goes).
BENCH_RESERVED = frozenset({"--base-url", "--host", "--port", "--embedded", "--model",
                            "--out-dir", "--result-dir", "--result-filename"})
DEFAULT_BENCH_CMD = "aphrodite bench serve"


@dataclass
class SweepServeSettings:
    serve_params: list[dict[str, Any]]
    bench_params: list[dict[str, Any]]
    folder: Path  # where the results, the logs and the summary go
    serve_cmd: str | None = None  # None: the embedded server
    bench_cmd: str = DEFAULT_BENCH_CMD
    model: str | None = None
    ready_timeout_s: float = READY_TIMEOUT_S


def bench_argv(cmd: str, root: str, model: str, folder: Path, name: str,
               params: dict[str, Any]) -> list[str]:
    """The ``bench serve`` command of one combination (``aphrodite`` is this install's)."""
    try:
        argv = shlex.split(cmd)
    except ValueError as exc:
        raise ConfigError(f"--bench-cmd {cmd!r} cannot be split into arguments ({exc})",
                          code="invalid_flag") from None
    if argv[:1] == ["aphrodite"]:
        argv[0] = str(BIN)
    if argv[1:3] != ["bench", "serve"]:
        raise ConfigError(f"--bench-cmd {cmd!r} is not an `aphrodite bench serve` command",
                          hint="its result file is what the sweep reads", code="invalid_flag")
    return [*argv, "--base-url", root, "--model", model, "--out-dir", str(folder),
            "--result-filename", name, *as_flags(params)]


def server_argv(settings: SweepServeSettings, params: dict[str, Any]) -> list[str]:
    """What starts the server of one serve set (for --dry-run and the summary)."""
    if settings.serve_cmd:
        return [*shlex.split(settings.serve_cmd), *as_flags(params)]
    return ["aphrodite", "serve", *([settings.model] if settings.model else []),
            *as_flags(params), "--port", "{port}"]


@contextlib.contextmanager
def server(settings: SweepServeSettings, index: int, params: dict[str, Any]
           ) -> Iterator[Target]:
    """The target of serve set ``index``, started and stopped around the block; a server that
    does not start is a one-line ConfigError naming the set and what the server said."""
    where = f"--serve-params set #{index} ({label(params)})"
    log = settings.folder / f"server-s{index}.log"
    command = None
    try:
        if settings.serve_cmd:
            command = CommandServer(settings.serve_cmd, as_flags(params), log)
            command.wait_ready(settings.ready_timeout_s)
            target = Target(command.base, model=settings.model)
        else:
            target = Target(embedded=True, model=settings.model, server_args=as_flags(params))
        target.__enter__()
    except ConfigError as exc:
        if command is not None:
            command.stop()
        raise ConfigError(f"{where}: the server did not start: {last_error(exc.message)}",
                          hint=f"its output: {log}" if settings.serve_cmd else
                          "the flags go to `aphrodite serve` as given (aphrodite serve --help)",
                          code="invalid_flag") from None
    try:
        yield target
    finally:
        if target.server is not None:
            log.write_text(target.server.output)
        target.stop()
        if command is not None:
            command.stop()


def phase_row(phase: dict[str, Any]) -> dict[str, Any]:
    """What the summary and the Pareto plot keep of a serve result's phase."""
    per_user = phase.get("output_token_throughput_per_user") or {}
    return {"completed": phase.get("completed"), "failed": phase.get("failed"),
            "request_throughput": phase.get("request_throughput"),
            "output_throughput": phase.get("output_throughput"),
            "total_token_throughput": phase.get("total_token_throughput"),
            "output_token_throughput_per_user": per_user.get("median"),
            "ttft_ms_median": (phase.get("ttft_ms") or {}).get("median"),
            "tpot_ms_median": (phase.get("tpot_ms") or {}).get("median")}


def pareto_front(points: list[tuple[float | None, float | None]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both;
    a point with a missing value is on no front)."""
    front = []
    for i, (x, y) in enumerate(points):
        if x is None or y is None:
            continue
        if not any(ox is not None and oy is not None and ox >= x and oy >= y
                   and (ox > x or oy > y) for ox, oy in points):
            front.append(i)
    return front


def mark_fronts(runs: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per phase, the runs (by position) on its Pareto front; each run's ``pareto`` too."""
    fronts: dict[str, list[int]] = {}
    phases = sorted({p for r in runs for p in r["phases"]})
    for phase in phases:
        rows = [(i, r["phases"][phase]) for i, r in enumerate(runs) if phase in r["phases"]]
        best = pareto_front([(row["total_token_throughput"],
                              row["output_token_throughput_per_user"]) for _, row in rows])
        fronts[phase] = [rows[k][0] for k in best]
        for k, (_, row) in enumerate(rows):
            row["pareto"] = k in best
    return fronts


def run_one(settings: SweepServeSettings, target: Target, i: int, j: int,
            serve: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    """Combination (i, j): its bench serve run, its result stamped with the combination."""
    from aphrodite_cli.bench.results.files import load_result

    name = f"serve-s{i}-b{j}.json"
    path = settings.folder / name
    argv = bench_argv(settings.bench_cmd, target.root, target.model, settings.folder, name,
                      bench)
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    log = settings.folder / f"bench-s{i}-b{j}.log"
    log.write_text(done.stdout + done.stderr)
    where = (f"--serve-params set #{i} ({label(serve)}) x --bench-params set #{j} "
             f"({label(bench)})")
    if not path.exists():  # it never ran: a bad flag, or a target it refused
        raise ConfigError(f"{where}: bench serve failed: {last_error(done.stderr or done.stdout)}",
                          hint=f"its output: {log}", code="invalid_flag")
    combination = {"serve_index": i, "bench_index": j, "serve_params": serve,
                   "bench_params": bench, "serve_cmd": server_argv(settings, serve),
                   "bench_cmd": argv}
    raw = json.loads(path.read_text())
    raw["sweep"] = combination
    path.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    doc = load_result(path, ("serve",))
    return {**{k: v for k, v in combination.items() if k != "bench_cmd"}, "result": name,
            "exit_code": done.returncode,
            "error": None if done.returncode == 0 else last_error(done.stderr or done.stdout),
            "phases": {phase: phase_row(p) for phase, p in doc["phases"].items()}}


def run_sweep(settings: SweepServeSettings, say: Callable[[str], Any]) -> dict[str, Any]:
    """Every combination, each server started once for its bench sets: the summary."""
    settings.folder.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, serve in enumerate(settings.serve_params):
        say(f"server #{i}: {label(serve)}")
        with server(settings, i, serve) as target:
            for j, bench in enumerate(settings.bench_params):
                say(f"  bench #{j}: {label(bench)}")
                runs.append(run_one(settings, target, i, j, serve, bench))
    return {"serve_cmd": settings.serve_cmd or "aphrodite serve (embedded)",
            "bench_cmd": settings.bench_cmd, "model": settings.model,
            "serve_params": settings.serve_params, "bench_params": settings.bench_params,
            "axes": {"x": "total_token_throughput",
                     "y": "output_token_throughput_per_user (median)"},
            "pareto": mark_fronts(runs), "runs": runs}


def failures(summary: dict[str, Any]) -> None:
    """A BenchmarkFailed naming the combinations whose bench serve exited non-zero."""
    bad = [f"#{r['serve_index']}x#{r['bench_index']} ({label(r['serve_params'])} | "
           f"{label(r['bench_params'])}): {r['error']}" for r in summary["runs"]
           if r["exit_code"]]
    if bad:
        raise BenchmarkFailed("; ".join(bad[:3]), hint="each run's output is in the sweep's "
                              "folder (bench-sI-bJ.log)", code="requests_failed")
