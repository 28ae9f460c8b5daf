"""``aphrodite bench mm-processor``: the engine's preprocessing offline, cold media against warm
(the processor cache), and the model's encoder timed on its own."""

from __future__ import annotations

import time
from typing import Any

from aphrodite_cli.bench.results.stats import summary
from engine.timings import PREPROCESSING_STAGES as STAGES


def _encoder_timer(loaded):
    """Runs one prefill of the model on processed inputs and returns the time its vision or
    audio encoder took (forward hooks), or None when the model has no such module."""
    import torch

    from engine.models.encoder import time_encoder
    from engine.processing import device_normalize

    model = loaded.model()
    spent: list[float] = []
    if not time_encoder(model, loaded.spec.encoder_attr, spent.append):
        return None

    norms = device_normalize.normalizers(loaded)

    def run(processed) -> float:
        spent.clear()
        ids = torch.tensor([processed.input_ids])
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids),
                  **device_normalize.apply(processed.mm, norms))
        return sum(spent)

    return run


def run_mm_processor(model: str | None, *, num_prompts: int, buckets: dict | None = None,
                     items: int = 1, media_delivery: str = "data-url", mode: str = "both",
                     seed: int = 0, video_backends: list[dict[str, Any]] | None = None,
                     encoder: bool = True, image_quality: int = 90,
                     jsonl: Any = None, media_dir: Any = None) -> dict[str, Any]:
    """The engine's preprocessing on a random-mm dataset, offline: fetch (loopback HTTP or
    data URL, through the same connector as the server), decode, hash, cache lookup, HF
    processor; then the model's encoder on the result, timed on its own (the processor cache
    does not skip it, so it is kept out of the preprocessing total). Cold media first (never
    seen), then warm (the same media again)."""
    import asyncio

    from aphrodite_cli.bench.data.datasets import (
        media_url,
        nonce,
        parse_buckets,
        random_mm,
        render_media,
    )
    from aphrodite_cli.bench.harness.media_host import MediaHost
    from engine.errors import InternalError
    from engine.models.loader import load_model
    from engine.processing.chat_parts import parse_messages
    from engine.processing.pipeline import Pipeline, pipeline_config

    loaded = load_model(model, weights=encoder)  # a hub model: no weights without the encoder
    buckets = buckets or parse_buckets('{"720,1280,1": 1}')
    # The server's pipeline, with its default settings; media from the loopback host only.
    pipeline = Pipeline(loaded, pipeline_config(allowed_media_domains=("127.0.0.1",)))
    cache, video = pipeline.cache, pipeline.video
    timer = _encoder_timer(loaded) if encoder else None
    if jsonl is not None:
        from aphrodite_cli.bench.data.datasets import load_jsonl

        rows = load_jsonl(jsonl, media_dir)
        dataset = (rows * (num_prompts // max(len(rows), 1) + 1))[:num_prompts]
    else:
        dataset = random_mm(num_prompts, items=items, buckets=buckets, prompt_len=8,
                            output_len=1, seed=seed, nonce=nonce())

    feature_ids = pipeline.preprocessor.feature_ids
    per_item: dict[str, list[float]] = {m: [] for m in feature_ids}

    async def run() -> dict[str, Any]:
        host = MediaHost() if media_delivery == "http" else None
        connector = pipeline.connector()
        prepared = []
        for req in dataset:
            if req.messages is not None:  # jsonl: the server's own message parsing
                parsed = parse_messages(req.messages)
                prepared.append((parsed.media, pipeline.render(parsed.messages)))
                continue
            refs = [(spec.kind, media_url(spec, render_media(spec, quality=image_quality), host))
                    for spec in req.media]
            parts = [{"type": kind} for kind, _ in refs] + [{"type": "text", "text": req.prompt}]
            prepared.append((refs, pipeline.render([{"role": "user", "content": parts}])))
        # Warm-up of imports and pools on media outside the dataset: never measured.
        extra = random_mm(1, items=1, buckets=buckets, prompt_len=2, output_len=1,
                          seed=seed + 1, nonce=nonce())[0]
        extra_refs = [(spec.kind, media_url(spec, render_media(spec), host))
                      for spec in extra.media]
        extra_text = pipeline.render([{"role": "user", "content": [
            *({"type": kind} for kind, _ in extra_refs), {"type": "text", "text": "x"}]}])
        warm_items, _ = await pipeline.fetch(connector, extra_refs, video)
        warmed = pipeline.process(extra_text, warm_items)
        if timer:
            timer(warmed)
        phases: dict[str, Any] = {}
        try:
            for phase in (("cold", "warm") if mode == "both" else (mode,)):
                if phase == "warm" and mode == "warm":
                    for refs, text in prepared:  # warm-up pass, not measured
                        got, _ = await pipeline.fetch(connector, refs, video)
                        pipeline.process(text, got)
                totals: list[float] = []
                stages: dict[str, list[float]] = {s: [] for s in STAGES}
                hits = count = 0
                results = []
                for refs, text in prepared:
                    start = time.perf_counter()
                    got, fetch_s = await pipeline.fetch(connector, refs, video)
                    result = pipeline.process(text, got)
                    totals.append(time.perf_counter() - start)  # preprocessing, as served
                    results.append(result)
                    stages["fetch_s"].append(fetch_s)
                    for s in STAGES[1:-1]:
                        stages[s].append(result.timings[s])
                    hits += sum(result.item_hits)
                    count += len(result.item_hits)
                # The encoder afterwards, in its own loop: torch's worker threads keep
                # spinning after a forward pass and would slow the next request's
                # preprocessing if the two were interleaved.
                stages["encoder_s"] = [timer(r) if timer else 0.0 for r in results]
                hit_rate = hits / count if count else 0.0
                if phase == "warm" and hit_rate < 0.99:
                    raise InternalError(f"warm phase hit rate {hit_rate:.0%}: the cache was "
                                        "not warm")
                if phase == "cold" and hit_rate > 0 and jsonl is None:
                    raise InternalError(f"cold phase hit rate {hit_rate:.0%}: media were not "
                                        "unique")
                for r in results if not phases else ():  # the first phase's
                    for modality, n in r.modality_counts.items():
                        if n:
                            per_item[modality].append(
                                r.input_ids.count(feature_ids[modality]) / n)
                after_fetch = [t - f for t, f in zip(totals, stages["fetch_s"], strict=True)]
                phases[phase] = {"total_s": summary(totals), "hit_rate": hit_rate,
                                 "after_fetch_s": summary(after_fetch),
                                 "stages": {s: summary(v) for s, v in stages.items()},
                                 "stage_totals_s": {s: sum(v) for s, v in stages.items()},
                                 "samples": {"total_ms": [t * 1e3 for t in totals]}}
        finally:
            await connector.close()
            if host:
                host.stop()
        return phases

    phases = asyncio.run(run())
    doc: dict[str, Any] = {
        "kind": "mm-processor", "model": loaded.name,
        "architecture": loaded.spec.name, "num_prompts": num_prompts, "mode": mode,
        "source": loaded.provenance,
        # model tokens each media item became (the placeholder's expansion), per modality
        "tokens_per_item": {m: summary(v) for m, v in per_item.items() if v},
        "dataset": {"name": "jsonl" if jsonl is not None else "random-mm",
                    "path": str(jsonl) if jsonl is not None else None,
                    "items_per_request": items,
                    "buckets": {",".join(map(str, k)): v for k, v in buckets.items()},
                    "image_quality": image_quality, "media_delivery": media_delivery},
        "encoder": bool(timer), "phases": phases,
        "cache": {"max_bytes": cache.max_bytes, **cache.stats.__dict__},
    }
    if video_backends:
        from aphrodite_cli.bench.offline.video_decode import run_video_backends

        doc["video_backends"] = run_video_backends(video_backends, seed=seed)
    if "cold" in phases and "warm" in phases:
        doc["cold_over_warm_median"] = (phases["cold"]["total_s"]["median"]
                                        / phases["warm"]["total_s"]["median"])
        # Without the fetch, which no cache can skip: hash, lookup, decode, HF processor.
        doc["cold_over_warm_median_after_fetch"] = (
            phases["cold"]["after_fetch_s"]["median"] / phases["warm"]["after_fetch_s"]["median"])
    return doc
