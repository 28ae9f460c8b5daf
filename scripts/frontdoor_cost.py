"""What the front-door and decode defences of issue 25 cost a valid request: two servers,
one per source tree (``--before`` and ``--after``, each a folder holding ``engine`` and
``aphrodite_cli``), the same valid requests sent to each in turn (interleaved, so machine
noise falls on both alike), median and p90 latency per kind, and the CPU the API server
process and its decode workers spent per request (less sensitive than latency to a busy
machine); then micro-timings of the per-item checks. Run from the repository root:

    python scripts/frontdoor_cost.py --before /tmp/base --after . --rounds 40
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image


def _image(side: int, fmt: str, **save) -> str:
    pixels = np.random.default_rng(side).integers(0, 256, (side, side * 3 // 4, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **save)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(out.getvalue()).decode()


def requests() -> dict[str, bytes]:
    def chat(content) -> bytes:
        return json.dumps({"max_tokens": 1, "messages": [
            {"role": "user", "content": content}]}).encode()

    return {
        "text": chat("Describe a sunset in one word."),
        "text 40 messages": json.dumps({"max_tokens": 1, "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
            for i in range(39)] + [{"role": "user", "content": "and now?"}]}).encode(),
        "progressive JPEG 640": chat([{"type": "image_url", "image_url": {
            "url": _image(640, "JPEG", progressive=True, quality=90)}}]),
        "PNG 1 MB body": chat([{"type": "image_url", "image_url": {
            "url": _image(560, "PNG")}}]),
    }


def post(base: str, body: bytes) -> float:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
        assert resp.status == 200
    return time.perf_counter() - start


def cpu_ms(pid: int) -> float:
    """CPU milliseconds of ``pid`` and its children (the decode workers), from /proc."""
    import subprocess

    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)],
                                                   capture_output=True, text=True).stdout.split()]
    total = 0
    for one in pids:
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total * 1000 / os.sysconf("SC_CLK_TCK")


def micro() -> dict[str, float]:
    from engine.media.image import count_jpeg_scans
    from engine.media.isolation import _cpu_seconds
    from engine.server.api.text_limits import TextLimits

    out = io.BytesIO()
    Image.new("RGB", (6000, 6000), (10, 20, 30)).save(out, "JPEG", progressive=True)
    big = _image(3000, "JPEG", progressive=True)
    big_bytes = base64.b64decode(big.split(",", 1)[1])
    limits = TextLimits(1 << 20, 8192)
    messages = [{"role": "user", "content": "x" * 200}] * 40

    def timed(fn, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    return {
        "count_jpeg_scans, 3000x2250 noise progressive JPEG (us)":
            timed(lambda: count_jpeg_scans(big_bytes, 10_000), 20),
        "count_jpeg_scans, 6000x6000 flat progressive JPEG (us)":
            timed(lambda: count_jpeg_scans(out.getvalue(), 10_000), 50),
        "text limits, 40 messages of 200 chars (us)": timed(lambda: limits.check_chat(messages),
                                                            2000),
        "CPU-time read of a worker, one poll (us)": timed(lambda: _cpu_seconds(1), 2000),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default=".")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.after).resolve()))
    from aphrodite_cli.bench.harness.server_process import ServerProcess

    servers = {}
    for name, tree in (("before", args.before), ("after", args.after)):
        servers[name] = ServerProcess("--mm-processor-cache-gb", "0", env={
            "PYTHONPATH": str(Path(tree).resolve())})
    for server in servers.values():
        server.wait_ready()
    pids = {name: server.pid_of("API server") for name, server in servers.items()}
    try:
        report: dict[str, dict[str, dict[str, float]]] = {}
        for kind, body in requests().items():
            times: dict[str, list[float]] = {name: [] for name in servers}
            for server in servers.values():  # warm up
                post(server.base, body)
            cpu = {name: cpu_ms(pids[name]) for name in servers}
            for i in range(args.rounds):
                order = list(servers.items())
                if i % 2:
                    order.reverse()
                for name, server in order:
                    times[name].append(post(server.base, body))
            cpu = {name: (cpu_ms(pids[name]) - cpu[name]) / args.rounds for name in servers}
            report[kind] = {name: {
                "median_ms": round(statistics.median(t) * 1e3, 2),
                "p90_ms": round(sorted(t)[int(0.9 * (len(t) - 1))] * 1e3, 2),
                "api_server_cpu_ms_per_request": round(cpu[name], 2)}
                for name, t in times.items()}
        report["micro"] = {k: round(v, 1) for k, v in micro().items()}  # type: ignore[assignment]
        print(json.dumps(report, indent=2))
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
