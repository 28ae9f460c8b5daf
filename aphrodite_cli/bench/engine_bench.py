"""Engine benchmarks: cold vs warm preprocessing (processor cache), and batching."""

from __future__ import annotations

import time
from typing import Any

from aphrodite_cli.bench.stats import summary

SCHEMA_VERSION = 1
STAGES = ("hash_s", "cache_lookup_s", "media_decode_s", "processor_s")


def run_mm_processor(model: str | None, *, width: int, height: int, num_prompts: int,
                     quality: int = 90, mode: str = "both", seed: int = 0) -> dict[str, Any]:
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
