"""Drive the engine process over its real socket (no HTTP, no preprocessing per request) and
print its RSS every N requests; writes results/engine-memory-*.json.

    .venv/bin/python scripts/engine_memory.py --requests 40000

Used to look into the engine's RSS rise seen by `aphrodite bench soak` (see issue notes): fresh
pixel tensors arrive with every request, as from an API server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import secrets
import tempfile
import time
from pathlib import Path


def _serve_with_heap_stats(stats_path: str, trim_every_s: float, trace_after_s: float,
                           **engine_args) -> None:
    """The engine process, plus a thread that calls malloc_trim every ``trim_every_s`` seconds
    when > 0. With ``trace_after_s`` > 0, Python allocations are traced: a snapshot at that
    time, and the biggest growth since then written to ``stats_path``.trace every 10 s. (The
    heap numbers themselves come from the engine's own stats message.)"""
    import threading
    import tracemalloc

    if trace_after_s > 0:
        tracemalloc.start(6)
    first: list = []

    def trace() -> None:
        if not first:
            first.append(tracemalloc.take_snapshot())
            return
        diff = tracemalloc.take_snapshot().compare_to(first[0], "traceback")
        lines = []
        for stat in diff[:8]:
            lines.append(f"{stat.size_diff / 1024:+.0f} KiB, {stat.count_diff:+d} blocks")
            lines.extend("    " + line for line in stat.traceback.format())
        Path(stats_path + ".trace").write_text("\n".join(lines))

    from engine.memory import trim
    from engine.server.process.engine_proc import serve_engine

    def report() -> None:
        last_trim = started = last_trace = time.monotonic()
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            if trace_after_s > 0 and now - started > trace_after_s and (
                    not first or now - last_trace > 10):
                trace()
                last_trace = now
            if trim_every_s > 0 and time.monotonic() - last_trim > trim_every_s:
                trim()
                last_trim = time.monotonic()

    threading.Thread(target=report, daemon=True).start()
    serve_engine(**engine_args)


async def main(requests: int, every: int, trim_every_s: float, trace_after_s: float) -> dict:
    from PIL import Image

    from aphrodite_cli.bench.harness import synthetic
    from engine import LLM
    from engine.config import EngineConfig
    from engine.processing.preprocess import MediaItem
    from engine.server.process.engine_client import EngineClient

    llm = LLM(mm_processor_cache_gb=0)
    prompts = [llm.prepare("<|vision_start|><|image_pad|><|vision_end|>Describe.", [MediaItem(
        "image", decoded=Image.fromarray(synthetic.image_array(96, 64, seed=k)))], None,
        False)[1] for k in range(20)]
    llm.engine.close()
    ctx = multiprocessing.get_context("spawn")
    address = os.path.join(tempfile.mkdtemp(prefix="aphrodite-"), "engine.sock")
    key = secrets.token_bytes(16)
    ready, child = ctx.Pipe(duplex=False)
    stats_path = os.path.join(os.path.dirname(address), "engine")
    proc = ctx.Process(target=_serve_with_heap_stats, args=(
        stats_path, trim_every_s, trace_after_s), kwargs=dict(
        address=address, authkey=key, model=None, chat_template=None, config=EngineConfig(),
        ready=child, api_servers=1), daemon=True)
    proc.start()
    child.close()
    ready.recv()
    client = EngineClient(address, key)
    rng = random.Random(0)
    series = []
    start = time.monotonic()

    async def one() -> None:
        p = prompts[rng.randrange(len(prompts))]
        mm = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in p.mm.items()}
        async for _ in client.generate(p.input_ids, mm, {"max_tokens": 4, "temperature": 0.8}):
            pass

    done = 0
    while done < requests:
        await asyncio.gather(*(one() for _ in range(4)))
        done += 4
        if done % every < 4:
            stats = await client.stats() or {}
            series.append({"requests": done, "t_s": round(time.monotonic() - start, 1),
                           **{k.replace("_bytes", "_mb"): int(v) >> 20 if k.endswith("_bytes")
                              else v for k, v in stats.items()}})
            print(series[-1], flush=True)
    client.close()
    if trace_after_s > 0:
        await asyncio.sleep(11)
        print(Path(stats_path + ".trace").read_text())
    proc.kill()
    return {"kind": "engine-memory", "requests": requests, "trim_every_s": trim_every_s,
            "series": series}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--trim-every-s", type=float, default=0,
                        help="call malloc_trim in the engine this often (0: never)")
    parser.add_argument("--trace-after-s", type=float, default=0,
                        help="trace Python allocations in the engine; compare to this time")
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args()
    doc = asyncio.run(main(args.requests, args.every, args.trim_every_s,
                          args.trace_after_s))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"engine-memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"result: {path}")
