"""Engine benchmarks: cold vs warm preprocessing (processor cache), and batching."""

from __future__ import annotations

import time
from typing import Any

from aphrodite_cli.bench.stats import summary

SCHEMA_VERSION = 1
STAGES = ("hash_s", "cache_lookup_s", "media_decode_s", "processor_s")


def run_video_backends(backends: list[str], *, clips: int = 3, width: int = 640,
                       height: int = 360, seconds: float = 2.0, gop: int = 30,
                       num_frames: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """The same videos decoded by each backend: decode time per backend and clip."""
    from engine.config import MediaLimits
    from engine.errors import AphroditeError, ConfigError
    from engine.media import synthetic
    from engine.media.video import load_video
    from engine.media.video.options import build_spec

    limits = MediaLimits.from_env()
    videos = [synthetic.make_video(width=width, height=height, seconds=seconds, gop=gop,
                                   seed=seed + i) for i in range(clips)]
    rows = []
    for backend in backends:
        spec = build_spec({"backend": backend, "num_frames": num_frames}, backend,
                          error=ConfigError)
        times, error = [], None
        try:
            load_video(videos[0], spec, limits)  # warm-up: imports
            for data in videos:
                times.append(load_video(data, spec, limits).metadata.decode_s)
        except AphroditeError as err:
            error = str(err)
        rows.append({"backend": backend, "clip": f"h264 {width}x{height} gop {gop} "
                     f"{int(seconds * 30)} frames", "frames_sampled": num_frames,
                     "clips": clips, "decode_ms": summary([t * 1e3 for t in times]),
                     "error": error})
    return rows


def run_mm_processor(model: str | None, *, width: int, height: int, num_prompts: int,
                     quality: int = 90, mode: str = "both", seed: int = 0,
                     video_backends: list[str] | None = None) -> dict[str, Any]:
    """Preprocess ``num_prompts`` distinct JPEGs cold (never seen), then the same warm."""
    from engine.config import MediaLimits
    from engine.errors import InternalError
    from engine.media import synthetic
    from engine.media.image import decode_image
    from engine.models.loader import load_model
    from engine.processing.cache import ProcessorCache
    from engine.processing.preprocess import MediaItem, Preprocessor
    from engine.processing.prompt import render_chat

    loaded = load_model(model)
    limits = MediaLimits.from_env()
    cache = ProcessorCache.from_gb(4)
    pre = Preprocessor(loaded, cache)
    prompt = render_chat(loaded, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe this image."}]}])
    images = [synthetic.make_image(width, height, fmt="JPEG", seed=seed + i, quality=quality)
              for i in range(num_prompts)]

    def item(data: bytes) -> MediaItem:
        return MediaItem("image", encoded=data, decode=lambda: decode_image(data, limits))

    pre.process(prompt, [item(synthetic.make_image(64, 64, seed=10_000))])  # warm-up imports
    phases: dict[str, Any] = {}
    for phase in (("cold", "warm") if mode == "both" else (mode,)):
        if phase == "warm" and mode == "warm":
            for data in images:  # warm-up pass, not measured
                pre.process(prompt, [item(data)])
        totals, stages, hits = [], {s: [] for s in STAGES}, 0
        for data in images:
            start = time.perf_counter()
            result = pre.process(prompt, [item(data)])
            totals.append(time.perf_counter() - start)
            hits += sum(result.item_hits)
            for s in STAGES:
                stages[s].append(result.timings[s])
        hit_rate = hits / len(images)
        if phase == "warm" and hit_rate < 0.99:
            raise InternalError(f"warm phase hit rate {hit_rate:.0%}: the cache was not warm")
        if phase == "cold" and hit_rate > 0:
            raise InternalError(f"cold phase hit rate {hit_rate:.0%}: media were not unique")
        phases[phase] = {"total_s": summary(totals), "hit_rate": hit_rate,
                         "stages": {s: summary(v) for s, v in stages.items()},
                         "samples": {"total_ms": [t * 1e3 for t in totals]}}
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "mm-processor", "model": loaded.name,
        "architecture": loaded.spec.name, "image": {"width": width, "height": height,
                                                    "format": "JPEG", "quality": quality},
        "num_prompts": num_prompts, "mode": mode, "phases": phases,
        "cache": {"max_bytes": cache.max_bytes, **cache.stats.__dict__},
    }
    if video_backends:
        doc["video_backends"] = run_video_backends(video_backends, seed=seed)
    if "cold" in phases and "warm" in phases:
        doc["cold_over_warm_median"] = (phases["cold"]["total_s"]["median"]
                                        / phases["warm"]["total_s"]["median"])
    return doc


def run_batching(model: str | None, *, concurrency: int, max_tokens: int, repeats: int
                 ) -> dict[str, Any]:
    """``concurrency`` image requests submitted together vs the same run one after another."""
    from PIL import Image

    from engine import LLM, SamplingParams
    from engine.executor.request import EngineRequest
    from engine.llm import to_items
    from engine.media import synthetic

    llm = LLM(model, max_batch_size=concurrency, mm_processor_cache_gb=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [{"prompt": f"Describe picture {i}.", "multi_modal_data": {
        "image": Image.fromarray(synthetic.image_array(320, 240, i))}} for i in range(concurrency)]
    llm.generate(prompts[0], params)  # warm-up
    prepared = [llm.prepare(p["prompt"], to_items(p["multi_modal_data"]), None, raw=True)
                for p in prompts]
    together, one_by_one = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        reqs = [llm.engine.submit(EngineRequest(pp, params)) for _, pp in prepared]
        for r in reqs:
            r.done.wait()
        together.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _, pp in prepared:
            llm.engine.submit(EngineRequest(pp, params)).done.wait()
        one_by_one.append(time.perf_counter() - start)
    llm.close()
    t, s = summary(together), summary(one_by_one)
    return {"schema_version": SCHEMA_VERSION, "kind": "batching", "model": llm.loaded.name,
            "concurrency": concurrency, "max_tokens": max_tokens, "repeats": repeats,
            "concurrent_s": t, "sequential_s": s,
            "speedup_median": s["median"] / t["median"]}
