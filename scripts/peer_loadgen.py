"""How fast the load generators send: ``aphrodite bench serve``, AIPerf and guidellm against one
zero-delay mock (``aphrodite bench mock-server``, every answer written at once, so the mock
costs little beside the client), at the same concurrency, request count and output length,
with 1 and N client processes each (ours ``--num-workers``, AIPerf ``--workers-max``,
guidellm ``GUIDELLM__MAX_WORKER_PROCESSES``). Each run's requests/s is completed requests /
the tool's own measured duration (AIPerf's ``request_throughput`` is that; guidellm's mean of
its per-second series is kept beside it). The runs are interleaved (every tool and worker
count once, then again) so a busy moment on a shared machine hits all of them.

AIPerf and guidellm are installed from PyPI at pinned versions, each into its own venv outside
the repository (``--venv-dir``, created only when missing). Their synthetic prompts need a
tokenizer: the project's tiny test model's (built locally, nothing downloaded). Writes
``results/peer-loadgen-<UTC time>.json`` and prints a table.

    .venv/bin/python scripts/peer_loadgen.py --workers 1,2 --num-prompts 4000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXE = Path(sys.executable).with_name("aphrodite")
#: ours run this tree's code (the venv's console script may point at another checkout)
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
#: Pinned peers (PyPI): bump deliberately, the venv's name carries the version.
PEERS = {"aiperf": "0.13.0", "guidellm": "0.8.1"}
#: Words per prompt in our random dataset (bench serve's --prompt-len default); the peers are
#: asked for as many tokens.
PROMPT_LEN = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the mock did not listen on {port} within {timeout:.0f} s")


def base_python() -> str:
    """The interpreter the peers' venvs are made with: this venv's base Python."""
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


def ensure_venv(tool: str, venv_dir: Path) -> Path:
    """``tool``'s console script in its own venv, created and installed only when missing."""
    venv = venv_dir / f"{tool}-{PEERS[tool]}"
    exe = venv / "bin" / tool
    if exe.exists():
        return exe
    venv_dir.mkdir(parents=True, exist_ok=True)
    print(f"installing {tool}=={PEERS[tool]} into {venv} ...", flush=True)
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                           f"{tool}=={PEERS[tool]}"], capture_output=True, text=True)
    if done.returncode != 0 or not exe.exists():
        shutil.rmtree(venv, ignore_errors=True)  # no half-built venv taken as built next time
        raise RuntimeError(f"pip install {tool}=={PEERS[tool]} failed: "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    return exe


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ours(url: str, workers: int, args: argparse.Namespace, tmp: Path) -> dict:
    name = f"ours-{workers}-{time.monotonic_ns()}.json"
    argv = [str(EXE), "bench", "serve", "--base-url", url, "--dataset-name", "random",
            "--num-prompts", str(args.num_prompts), "--num-warmups", "0", "--mode", "cold",
            "--prompt-len", str(PROMPT_LEN), "--output-len", str(args.output_len),
            "--max-concurrency", str(args.max_concurrency), "--num-workers", str(workers),
            "--no-server-cpu", "--no-reset-caches", "--abort-after-failures", "0",
            "--out-dir", str(tmp), "--result-filename", name, "--output-format", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve: {done.stderr[-800:]}")
    phase = json.loads((tmp / name).read_text())["phases"]["cold"]
    return {"request_throughput": phase["request_throughput"], "completed": phase["completed"],
            "failed": phase["failed"], "duration_s": phase["duration_s"]}


def aiperf(exe: Path, url: str, workers: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"aiperf-{workers}-{time.monotonic_ns()}"
    argv = [str(exe), "profile", "--model", "mock", "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", args.tokenizer, "--concurrency",
            str(args.max_concurrency), "--request-count", str(args.num_prompts),
            "--prompt-input-tokens-mean", str(PROMPT_LEN),
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean",
            str(args.output_len), "--prompt-output-tokens-stddev", "0", "--extra-inputs",
            "ignore_eos:true", "--use-server-token-count", "--ui", "none",
            "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", str(workers),
            "--output-artifact-dir", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
    export = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.exists():
        raise RuntimeError(f"aiperf exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}")
    doc = json.loads(export.read_text())
    return {"request_throughput": doc["request_throughput"]["avg"],
            "completed": int(doc["completed_request_count"]["avg"]),
            "failed": int(doc.get("error_request_count", {}).get("avg", 0)),
            "duration_s": doc["benchmark_duration"]["avg"]}


def guidellm(exe: Path, url: str, workers: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"guidellm-{workers}-{time.monotonic_ns()}.json"
    argv = [str(exe), "run", "--backend", f"kind=openai_http,target={url},model=mock",
            "--profile", f"kind=concurrent,streams={args.max_concurrency}",
            "--constraint", f"kind=max_requests,count={args.num_prompts}",
            "--tokenizer", f"kind=hf_auto,model={args.tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_LEN},"
                      f"output_tokens={args.output_len}",
            "--output", f"kind=json,path={out}", "--disable-progress"]
    # its worker processes: min(concurrency, this setting), 10 by default
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exit {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-800:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    return {"request_throughput": totals["successful"] / bench["duration"],
            "tool_requests_per_second_mean":
                bench["metrics"]["requests_per_second"]["successful"]["mean"],
            "completed": totals["successful"], "failed": totals["errored"],
            "duration_s": bench["duration"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="client processes per tool")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--tools", default="aphrodite,aiperf,guidellm")
    parser.add_argument("--tokenizer", default=None,
                        help="for the peers' prompts (default: the tiny test model's)")
    parser.add_argument("--venv-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "aphrodite" / "peer-venvs")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    tools = args.tools.split(",")
    if args.tokenizer is None:
        from engine.models.loader import resolve_model_path

        args.tokenizer = str(resolve_model_path("tiny:qwen2_vl"))
    problems: dict[str, str] = {}
    exes: dict[str, Path] = {}
    for tool in tools:
        if tool in PEERS:
            try:
                exes[tool] = ensure_venv(tool, args.venv_dir)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                problems[tool] = f"install: {exc}"
                print(f"{tool}: not measured ({problems[tool][:300]})", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([str(EXE), "bench", "mock-server", "--port", str(port)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = []
    try:
        wait_port(port)
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                for tool in tools:
                    if tool in problems:
                        continue
                    for workers in counts:
                        load = os.getloadavg()[0]
                        mock_cpu, client_cpu = process_cpu_s(mock.pid), children_cpu_s()
                        try:
                            row = (ours(url, workers, args, Path(tmp)) if tool == "aphrodite"
                                   else globals()[tool](exes[tool], url, workers, args,
                                                        Path(tmp)))
                        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
                            problems[tool] = f"run: {exc}"
                            print(f"{tool}: failed ({str(exc)[:300]})", flush=True)
                            break
                        row.update(tool=tool, workers=workers, load_average_1m_before=load,
                                   client_cpu_s=children_cpu_s() - client_cpu,
                                   mock_cpu_s=process_cpu_s(mock.pid) - mock_cpu)
                        runs.append(row)
                        print(f"{tool} x{workers}: {row['request_throughput']:.0f} req/s "
                              f"({row['completed']} done, {row['failed']} failed), load "
                              f"{load:.1f}", flush=True)
    finally:
        mock.terminate()
        mock.wait(30)
    best = {tool: {str(w): max((r["request_throughput"] for r in runs
                                if r["tool"] == tool and r["workers"] == w), default=None)
                   for w in counts} for tool in tools}
    doc = {"kind": "peer-loadgen",
           "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "cpus": os.cpu_count(), "versions": PEERS, "num_prompts": args.num_prompts,
           "max_concurrency": args.max_concurrency, "output_len": args.output_len,
           "prompt_len": PROMPT_LEN, "tokenizer": args.tokenizer, "runs": runs,
           "best_request_throughput": best, "not_measured": problems,
           "load_average_after": os.getloadavg()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"peer-loadgen-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for tool in tools:
        print(f"{tool}: " + ", ".join(f"{w} worker(s) {v:.0f} req/s" if v else
                                       f"{w} worker(s) -" for w, v in best[tool].items()))
    print(f"result: {path}")


if __name__ == "__main__":
    main()
