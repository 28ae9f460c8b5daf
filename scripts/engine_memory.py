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


def rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


async def main(requests: int, every: int) -> dict:
    from PIL import Image

    from engine import LLM
    from engine.media import synthetic
    from engine.processing.preprocess import MediaItem
    from engine.server.engine_client import EngineClient
    from engine.server.engine_proc import serve_engine

    llm = LLM(mm_processor_cache_gb=0)
    prompts = [llm.prepare("<|vision_start|><|image_pad|><|vision_end|>Describe.", [MediaItem(
        "image", decoded=Image.fromarray(synthetic.image_array(96, 64, seed=k)))], None,
        False)[1] for k in range(20)]
    llm.engine.close()
    ctx = multiprocessing.get_context("spawn")
    address = os.path.join(tempfile.mkdtemp(prefix="aphrodite-"), "engine.sock")
    key = secrets.token_bytes(16)
    ready, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=serve_engine, args=(address, key, None, None, 8, "cpu", "auto",
                                                  child, 1), daemon=True)
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
            series.append({"requests": done, "rss_mb": rss_mb(proc.pid),
                           "t_s": round(time.monotonic() - start, 1)})
            print(series[-1], flush=True)
    client.close()
    proc.kill()
    return {"kind": "engine-memory", "requests": requests, "series": series}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args()
    doc = asyncio.run(main(args.requests, args.every))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"engine-memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"result: {path}")
