"""How fast ``aphrodite bench serve`` can send: client requests/s against a zero-delay mock at
1, 2 and N ``--num-workers``. The mock is ``load/instant_mock.py`` (every answer built once and
written in one piece: about a tenth of the client's CPU per request) run as
``--mock-processes`` processes sharing one port (SO_REUSEPORT), so the server side is not what
limits the client. Each point is a whole ``bench serve`` run (text-only requests,
--max-concurrency C, every request answered at once); its requests/s, the client's CPU per
request (the bench process and its workers, start-up included), the mock's CPU per request
and the machine's load average are kept. The runs are interleaved (1, 2, ..., then again) so
a busy moment hits every value; the speed-up is given best against best and as the median
of each round's own ratio. Writes ``results/client-scaling-<UTC time>.json`` and prints a
table.

    .venv/bin/python scripts/client_scaling.py --workers 1,2,4 --num-prompts 4000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("aphrodite")

MOCK = """
import sys
from aphrodite_cli.bench.load.instant_mock import run
run("127.0.0.1", int(sys.argv[1]), reuse_port=True)
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


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(base: str, workers: int, args: argparse.Namespace, out: Path,
            mocks: list[int], env: dict[str, str]) -> dict:
    name = f"w{workers}-{time.monotonic_ns()}.json"
    argv = [str(EXE), "bench", "serve", "--base-url", base, "--dataset-name", "random",
            "--num-prompts", str(args.num_prompts), "--num-warmups", "0", "--mode", "cold",
            "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
            "--num-workers", str(workers), "--no-server-cpu", "--no-reset-caches",
            "--abort-after-failures", "0", "--out-dir", str(out), "--result-filename", name,
            "--output-format", "json"]
    load = os.getloadavg()[0]
    cpu, mock_cpu = children_cpu_s(), sum(map(process_cpu_s, mocks))
    done = subprocess.run(argv, capture_output=True, text=True, env=env)  # this tree's code
    cpu = children_cpu_s() - cpu  # the bench process and its workers (reaped with it)
    mock_cpu = sum(map(process_cpu_s, mocks)) - mock_cpu
    if done.returncode != 0:
        raise SystemExit(f"bench serve --num-workers {workers} failed: {done.stderr[-800:]}")
    phase = json.loads((out / name).read_text())["phases"]["cold"]
    return {"num_workers": workers, "requests": phase["completed"] + phase["failed"],
            "completed": phase["completed"], "failed": phase["failed"],
            "request_throughput": phase["request_throughput"],
            "duration_s": phase["duration_s"], "ttft_ms_median": phase["ttft_ms"]["median"],
            "client_cpu_ms_per_request": cpu * 1e3 / max(phase["completed"], 1),
            "mock_cpu_ms_per_request": mock_cpu * 1e3 / max(phase["completed"], 1),
            "load_average_1m_before": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="--num-workers values")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--mock-processes", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
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
                    row = one_run(f"http://127.0.0.1:{port}", workers, args, Path(tmp),
                                  [m.pid for m in mocks], env)
                    rows.append(row)
                    print(f"--num-workers {workers}: {row['request_throughput']:.0f} req/s "
                          f"({row['completed']}/{row['requests']}), client "
                          f"{row['client_cpu_ms_per_request']:.2f} ms CPU/request, mock "
                          f"{row['mock_cpu_ms_per_request']:.3f}, load "
                          f"{row['load_average_1m_before']:.1f}", flush=True)
    finally:
        for mock in mocks:
            mock.terminate()
        for mock in mocks:
            mock.wait(30)
    best = {w: max(r["request_throughput"] for r in rows if r["num_workers"] == w)
            for w in counts}
    rounds = [rows[k:k + len(counts)] for k in range(0, len(rows), len(counts))]
    # each round's own ratio: runs close in time saw the same machine
    ratios = {w: statistics.median(r[i]["request_throughput"] / r[0]["request_throughput"]
                                   for r in rounds) for i, w in enumerate(counts)}
    doc = {"kind": "client-scaling", "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime()),
           "cpus": os.cpu_count(), "mock_processes": args.mock_processes,
           "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
           "output_len": args.output_len, "runs": rows,
           "best_request_throughput": {str(w): v for w, v in best.items()},
           "speedup_over_one_worker": {str(w): v / best[counts[0]] for w, v in best.items()}
           if counts[0] == 1 else None,
           "median_round_speedup": {str(w): v for w, v in ratios.items()}
           if counts[0] == 1 else None}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"client-scaling-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for w in counts:
        print(f"{w} worker(s): best {best[w]:.0f} req/s"
              + (f", {best[w] / best[counts[0]]:.2f}x best/best, {ratios[w]:.2f}x median of "
                 "rounds" if counts[0] == 1 else ""))
    print(f"result: {path}")


if __name__ == "__main__":
    main()
