"""Sample this machine's GPUs through bench serve's telemetry (NVML via nvidia-ml-py) for a few
seconds and print the phase's ``telemetry`` section as JSON, for a real-GPU check.

    python scripts/gpu_telemetry_check.py [--seconds 4] [--interval 0.25] [--load]
                                          [--base-url http://127.0.0.1:2242]

``--load`` runs half-precision matrix products on GPU 0 (torch) for the middle of the window,
so utilisation and memory must rise above their idle readings; ``--base-url`` also scrapes
that server's /metrics (without it a loopback stub answers an empty /metrics). Exit 1 when
NVML gives no GPU, or with ``--load`` when GPU 0's utilisation never rose above 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp import web

from aphrodite_cli.bench.load.telemetry import Telemetry


def _matmuls(stop: threading.Event) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.float16)
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


async def main(args: argparse.Namespace) -> int:
    runner = None
    root = args.base_url
    if root is None:  # a stub target: the GPU is what is checked
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="# TYPE vllm:num_requests_running gauge\n"
                                     "vllm:num_requests_running 0\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        root = f"http://127.0.0.1:{runner.addresses[0][1]}"
    telemetry = Telemetry(root.rstrip("/"), args.interval)
    stop = threading.Event()
    worker = threading.Thread(target=_matmuls, args=(stop,), daemon=True) if args.load else None
    await telemetry.start()
    await asyncio.sleep(args.seconds / 4)
    if worker is not None:
        worker.start()
    await asyncio.sleep(args.seconds / 2)
    stop.set()
    if worker is not None:
        await asyncio.to_thread(worker.join, 60)
    await asyncio.sleep(args.seconds / 4)
    await telemetry.stop()
    if runner is not None:
        await runner.cleanup()
    result = telemetry.result()
    print(json.dumps(result, indent=1))
    gpu = result["gpu"]
    if not gpu["available"]:
        print(f"FAIL: no GPU sampled: {gpu['reason']}", file=sys.stderr)
        return 1
    peak = max((g["gpu_util_pct"] or 0) for s in gpu["samples"] for g in s["gpus"]
               if g["index"] == 0)
    print(f"GPU 0 ({gpu['devices'][0]['name']}): {len(gpu['samples'])} samples, "
          f"peak utilisation {peak:g}%", file=sys.stderr)
    if args.load and peak <= 0:
        print("FAIL: GPU 0's utilisation never rose under --load", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--base-url")
    started = time.perf_counter()
    code = asyncio.run(main(parser.parse_args()))
    print(f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    sys.exit(code)
