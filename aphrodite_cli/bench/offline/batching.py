"""``aphrodite bench batching``: concurrent requests against one after another
(:func:`run_batching`), and (``--workload mixed``) static against continuous batching on the
same engine (:func:`run_mixed`).

``--workload mixed`` makes two measurements, each run with ``scheduling="static"`` and
``"continuous"`` alternately (A, B, A, B) on one loaded model:

- *mixed lengths*: ``num_prompts`` requests sent at once, one in four long (``max_tokens``),
  the others short, with ``max_num_seqs`` = ``concurrency``: output tokens/s, requests/s, wall
  time and TTFT of the short requests;
- *short behind long*: a short request sent while one long generation runs, against the same
  short request alone: its TTFT, and whether it finished before the long one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from aphrodite_cli.bench.results.stats import summary

MODES = ("static", "continuous")


def _prepared(llm: Any, count: int) -> list[Any]:
    from PIL import Image

    from aphrodite_cli.bench.harness import synthetic
    from engine.llm import to_items

    out = []
    for i in range(count):
        if i % 2:
            out.append(llm.prepare(f"Say something about {i}.", [], None, raw=True)[1])
        else:
            image = Image.fromarray(synthetic.image_array(160, 120, i))
            out.append(llm.prepare(f"Describe picture {i}.", to_items({"image": image}), None,
                                   raw=True)[1])
    return out


def _mixed_once(llm: Any, prompts: list[Any], long_tokens: int, short_tokens: int
                ) -> dict[str, Any]:
    from engine import SamplingParams
    from engine.executor.request import EngineRequest

    lengths = [long_tokens if i % 4 == 0 else short_tokens for i in range(len(prompts))]
    start = time.perf_counter()
    reqs = [llm.engine.submit(EngineRequest(p, SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True))) for p, n in zip(prompts, lengths,
                                                                        strict=True)]
    for r in reqs:
        r.done.wait()
    wall = time.perf_counter() - start
    failed = [r for r in reqs if r.error is not None]
    tokens = sum(len(o.token_ids) for r in reqs for o in r.outputs)
    short_ttft = [r.timings["first_token_s"] for r, n in zip(reqs, lengths, strict=True)
                  if n == short_tokens and r.error is None]
    return {"wall_s": wall, "output_tokens": tokens, "failed": len(failed),
            "output_throughput": tokens / wall, "request_throughput": len(reqs) / wall,
            "short_ttft_s": short_ttft}


def _behind_long_once(llm: Any, long_prompt: Any, short_prompt: Any, long_tokens: int,
                      short_tokens: int) -> dict[str, Any]:
    from engine import SamplingParams
    from engine.executor.request import EngineRequest

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    alone = llm.engine.submit(EngineRequest(short_prompt, params(short_tokens)))
    alone.done.wait()
    started = threading.Event()
    long = llm.engine.submit(EngineRequest(long_prompt, params(long_tokens),
                                           on_event=lambda _e: started.set()))
    started.wait()
    short = llm.engine.submit(EngineRequest(short_prompt, params(short_tokens)))
    short.done.wait()
    finished_first = not long.done.is_set()
    long.done.wait()
    return {"solo_ttft_s": alone.timings["first_token_s"],
            "behind_long_ttft_s": short.timings["first_token_s"],
            "finished_before_long": finished_first}


def run_mixed(model: str | None, *, concurrency: int, max_tokens: int, repeats: int,
              num_prompts: int | None = None, short_tokens: int | None = None,
              behind_long_tokens: int = 512) -> dict[str, Any]:
    from dataclasses import replace

    from engine import LLM

    llm = LLM(model, max_num_seqs=concurrency, mm_processor_cache_gb=0)
    num_prompts = num_prompts or 4 * concurrency
    short_tokens = short_tokens or max(4, max_tokens // 16)
    prompts = _prepared(llm, num_prompts)
    _mixed_once(llm, prompts[:2], 2, 2)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    behind: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:  # interleaved, so drift on a shared machine hits both alike
            llm.engine.config = replace(llm.engine.config, scheduling=mode)
            runs[mode].append(_mixed_once(llm, prompts, max_tokens, short_tokens))
            behind[mode].append(_behind_long_once(llm, prompts[0], prompts[1],
                                                  behind_long_tokens, 4))
    llm.close()
    doc: dict[str, Any] = {
        "kind": "batching", "workload": "mixed", "model": llm.loaded.name,
        "max_num_seqs": concurrency, "num_prompts": num_prompts, "long_tokens": max_tokens,
        "short_tokens": short_tokens, "long_share": 0.25, "repeats": repeats,
        "behind_long_tokens": behind_long_tokens}
    for mode in MODES:
        rows = runs[mode]
        doc[mode] = {
            "wall_s": summary([r["wall_s"] for r in rows]),
            "output_throughput": summary([r["output_throughput"] for r in rows]),
            "request_throughput": summary([r["request_throughput"] for r in rows]),
            "short_ttft_s": summary([t for r in rows for t in r["short_ttft_s"]]),
            "failed": sum(r["failed"] for r in rows),
            "short_behind_long": {
                "solo_ttft_s": summary([b["solo_ttft_s"] for b in behind[mode]]),
                "behind_long_ttft_s": summary([b["behind_long_ttft_s"] for b in behind[mode]]),
                "finished_before_long": [b["finished_before_long"] for b in behind[mode]]}}
        ttft = doc[mode]["short_behind_long"]
        ttft["ttft_ratio_median"] = (ttft["behind_long_ttft_s"]["median"]
                                     / ttft["solo_ttft_s"]["median"])
    doc["continuous_over_static_output_throughput"] = (
        doc["continuous"]["output_throughput"]["median"]
        / doc["static"]["output_throughput"]["median"])
    return doc


def run_batching(model: str | None, *, concurrency: int, max_tokens: int, repeats: int
                 ) -> dict[str, Any]:
    """``concurrency`` image requests submitted together vs the same run one after another."""
    from PIL import Image

    from aphrodite_cli.bench.harness import synthetic
    from engine import LLM, SamplingParams
    from engine.executor.request import EngineRequest
    from engine.llm import to_items

    llm = LLM(model, max_num_seqs=concurrency, mm_processor_cache_gb=0)
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
    return {"kind": "batching", "model": llm.loaded.name,
            "concurrency": concurrency, "max_tokens": max_tokens, "repeats": repeats,
            "concurrent_s": t, "sequential_s": s,
            "speedup_median": s["median"] / t["median"]}
