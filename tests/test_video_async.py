"""Decoding off the event loop, several videos in parallel."""

from __future__ import annotations

import asyncio
import threading

from engine.config import MediaLimits
from engine.media import synthetic
from engine.media.video import load_video_async
from engine.media.video.budget import GpuDecodeBudget
from engine.media.video.options import server_video_spec


async def test_videos_decode_in_parallel_off_the_loop():
    clips = [synthetic.make_video(width=96, height=64, seconds=1, seed=s) for s in range(4)]
    spec = server_video_spec({"video": {"backend": "pyav", "num_frames": 4}})
    ticks = 0

    async def heartbeat():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    beat = asyncio.create_task(heartbeat())
    results = await asyncio.gather(*(load_video_async(c, spec, MediaLimits.from_env())
                                     for c in clips))
    beat.cancel()
    assert [r.frames.shape for r in results] == [(4, 64, 96, 3)] * 4
    assert ticks > 5  # the loop kept running while decoding happened elsewhere
    assert any(t.name.startswith("aphrodite-decode") for t in threading.enumerate())


async def test_gpu_backend_holds_the_budget_while_decoding():
    clip = synthetic.make_video(width=64, height=48, seconds=0.5)
    spec = server_video_spec({"video": {"backend": "deepstream", "num_frames": 4}})
    budget = GpuDecodeBudget(64 * 48 * 3 * 4)  # exactly one decode's frames
    results = await asyncio.gather(*(load_video_async(clip, spec, MediaLimits.from_env(),
                                                      budget) for _ in range(3)))
    assert all(r.frames.shape == (4, 48, 64, 3) for r in results)
    assert budget.in_use == 0
