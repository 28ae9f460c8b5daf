"""How fast ``aphrodite bench serve`` can send: client requests/s against a zero-delay mock at
1, 2 and N ``--num-workers``. The mock runs as ``--mock-processes`` processes sharing one port
(SO_REUSEPORT), so the server side is not what limits the client. Each point is a whole
``bench serve`` run (text-only requests, --max-concurrency C, every request answered at once);
its requests/s, the client's CPU seconds per request (the bench process and its workers) and
the machine's load average are kept. Writes ``results/client-scaling-<UTC time>.json`` and
prints a table.

    .venv/bin/python scripts/client_scaling.py --workers 1,2,4 --num-prompts 4000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("aphrodite")

MOCK = """
import sys
from aiohttp import web
from aphrodite_cli.bench.load.mock_server import create_app
web.run_app(create_app(0, 0, None), host="127.0.0.1", port=int(sys.argv[1]), print=None,
            access_log=None, reuse_port=True)
"""


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


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(base: str, workers: int, args: argparse.Namespace, out: Path) -> dict:
    name = f"w{workers}-{time.monotonic_ns()}.json"
    argv = [str(EXE), "bench", "serve", "--base-url", base, "--dataset-name", "random",
            "--num-prompts", str(args.num_prompts), "--num-warmups", "0", "--mode", "cold",
            "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
            "--num-workers", str(workers), "--no-server-cpu", "--no-reset-caches",
            "--abort-after-failures", "0", "--out-dir", str(out), "--result-filename", name,
            "--output-format", "json"]
    load = os.getloadavg()[0]
    cpu = children_cpu_s()
    done = subprocess.run(argv, capture_output=True, text=True)
    cpu = children_cpu_s() - cpu  # the bench process and its workers (reaped with it)
    if done.returncode != 0:
        raise SystemExit(f"bench serve --num-workers {workers} failed: {done.stderr[-800:]}")
    phase = json.loads((out / name).read_text())["phases"]["cold"]
    return {"num_workers": workers, "requests": phase["completed"] + phase["failed"],
            "completed": phase["completed"], "failed": phase["failed"],
            "request_throughput": phase["request_throughput"],
            "duration_s": phase["duration_s"], "ttft_ms_median": phase["ttft_ms"]["median"],
            "client_cpu_ms_per_request": cpu * 1e3 / max(phase["completed"], 1),
            "load_average_1m_before": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="--num-workers values")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--mock-processes", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--repeats", type=int, default=2, help="runs per value (best kept)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    mocks = [subprocess.Popen([sys.executable, "-c", MOCK, str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(args.mock_processes)]
    rows = []
    try:
        wait_port(port)
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):  # interleaved: a busy moment hits every value
                for workers in counts:
                    row = one_run(f"http://127.0.0.1:{port}", workers, args, Path(tmp))
                    rows.append(row)
                    print(f"--num-workers {workers}: {row['request_throughput']:.0f} req/s "
                          f"({row['completed']}/{row['requests']}), client "
                          f"{row['client_cpu_ms_per_request']:.2f} ms CPU/request, load "
                          f"{row['load_average_1m_before']:.1f}", flush=True)
    finally:
        for mock in mocks:
            mock.terminate()
        for mock in mocks:
            mock.wait(30)
    best = {w: max(r["request_throughput"] for r in rows if r["num_workers"] == w)
            for w in counts}
    doc = {"kind": "client-scaling", "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime()),
           "cpus": os.cpu_count(), "mock_processes": args.mock_processes,
           "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
           "output_len": args.output_len, "runs": rows,
           "best_request_throughput": {str(w): v for w, v in best.items()},
           "speedup_over_one_worker": {str(w): v / best[counts[0]] for w, v in best.items()}
           if counts[0] == 1 else None}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"client-scaling-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for w in counts:
        print(f"{w} worker(s): best {best[w]:.0f} req/s"
              + (f", {best[w] / best[counts[0]]:.2f}x" if counts[0] == 1 else ""))
    print(f"result: {path}")


if __name__ == "__main__":
    main()
