"""How long running rows wait while a long prompt is prefilled, by
``--long-prefill-token-threshold``: the embedded engine (the offline ``LLM``, in this process)
keeps ``--rows`` rows decoding long greedy answers, then a prompt of about ``--prompt-tokens``
tokens arrives; per threshold, the longest gap between two tokens of a running row from its
arrival until its answer ends, and its time to first token. The thresholds are interleaved
``--repeats`` times on one engine per model (its ``config`` swapped between runs; the prefix
cache off, so each run prefills the whole prompt; ``--overlap-prefill`` off, so the prefill
runs on the engine's thread as it does by default when the threads fill the cores). Writes
``results/prefill-gap-<date>.json``.

    .venv/bin/python scripts/prefill_gap.py --sizes tiny small --thresholds 0 512 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def long_prompt(llm: Any, tokens: int) -> Any:
    """A text prompt of about ``tokens`` tokens (numbered words, so no two lines are one
    token), as the pipeline renders it."""
    line = "Item {} of the list, written out in words for the reader. "
    per = len(llm.prepare("".join(line.format(i) for i in range(100)), [], None, True)[1]
              .input_ids) / 100
    count = max(int(tokens / per), 1)
    while True:
        prompt = llm.prepare("".join(line.format(i) for i in range(count)), [], None, True)[1]
        if len(prompt.input_ids) <= tokens or count == 1:
            return prompt
        count -= 1 + (len(prompt.input_ids) - tokens) // max(int(per), 1)


def one_run(llm: Any, prompt: Any, rows: int, answer_tokens: int) -> dict[str, Any]:
    """``rows`` rows decode; once each has 8 tokens the long prompt arrives. The longest
    gap between two tokens of a running row while it is prefilled and answered, the running
    rows' median gap before it arrived, and its TTFT."""
    from engine import SamplingParams
    from engine.executor.request import EngineRequest

    short = llm.prepare("Tell a long story.", [], None, True)[1]
    stamps: list[list[float]] = [[] for _ in range(rows)]
    warm = threading.Event()

    def recorder(i: int):
        def on_event(event) -> None:
            if event.token_id is not None:
                stamps[i].append(time.perf_counter())
                if all(len(s) >= 8 for s in stamps):
                    warm.set()
        return on_event

    limit = 4096 - len(short.input_ids) - 1
    running = [llm.engine.submit(EngineRequest(short, SamplingParams(
        max_tokens=limit, temperature=0, ignore_eos=True), on_event=recorder(i)))
        for i in range(rows)]
    if not warm.wait(300):
        raise RuntimeError("the running rows did not start")
    first: list[float] = []
    sent = time.perf_counter()
    long = llm.engine.submit(EngineRequest(prompt, SamplingParams(
        max_tokens=answer_tokens, temperature=0, ignore_eos=True),
        on_event=lambda e: first.append(time.perf_counter()) if e.token_id is not None
        else None))
    if not long.done.wait(600) or long.error is not None:
        raise RuntimeError(f"the long prompt failed: {long.error}")
    ended = time.perf_counter()
    if any(req.done.is_set() for req in running):
        raise RuntimeError("a running row ended before the long prompt's answer did")
    for req in running:
        req.cancel()
    for req in running:
        req.done.wait(60)
    before, during = [], []
    for times in stamps:
        for a, b in itertools.pairwise(times):
            if b <= sent:
                before.append(b - a)
            elif a <= ended:
                during.append(b - a)
    return {"ttft_s": round(first[0] - sent, 4), "max_gap_s": round(max(during), 4),
            "median_gap_before_s": round(statistics.median(before), 4),
            "prompt_tokens": len(prompt.input_ids)}


def measure(size: str, thresholds: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM
    from engine.models.loader import tiny_model_dir

    settings: dict[str, Any] = {"num_threads": args.num_threads, "max_num_seqs": args.rows + 1,
                                "enable_prefix_caching": False, "overlap_prefill": False}
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(str(tiny_model_dir("qwen2_5_vl", size=size)), **settings)
    try:
        base = llm.engine.config
        prompt = long_prompt(llm, args.prompt_tokens)
        llm.engine.config = replace(base, long_prefill_token_threshold=0)
        one_run(llm, prompt, args.rows, args.answer_tokens)  # warm-up (packing, allocations)
        runs: dict[int, list[dict[str, Any]]] = {t: [] for t in thresholds}
        for _ in range(args.repeats):
            for threshold in thresholds:
                llm.engine.config = replace(base, long_prefill_token_threshold=threshold)
                runs[threshold].append(one_run(llm, prompt, args.rows, args.answer_tokens))
                last = runs[threshold][-1]
                print(f"{size} threshold {threshold}: longest gap "
                      f"{last['max_gap_s'] * 1e3:.0f} ms, TTFT {last['ttft_s']:.2f} s",
                      flush=True)
    finally:
        llm.close()
    summary = {str(t): {"max_gap_ms_median": round(statistics.median(
        r["max_gap_s"] for r in runs[t]) * 1e3, 1),
        "ttft_s_median": round(statistics.median(r["ttft_s"] for r in runs[t]), 3),
        "step_ms_before_median": round(statistics.median(
            r["median_gap_before_s"] for r in runs[t]) * 1e3, 1),
        "runs": runs[t]} for t in thresholds}
    return {"prompt_tokens": len(prompt.input_ids), "token_budget": base.token_budget,
            "thresholds": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"],
                        help="model sizes (aphrodite model make-tiny --size)")
    parser.add_argument("--thresholds", nargs="+", type=int, default=[0, 512, 256])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--rows", type=int, default=3, help="rows decoding meanwhile")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: the engine's (2048 on a CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import os

    from aphrodite_cli.bench.results.environment import capture

    result = {"kind": "prefill-gap", "created_utc": datetime.now().astimezone().isoformat(),
              "rows": args.rows, "answer_tokens": args.answer_tokens,
              "repeats": args.repeats, "num_threads": args.num_threads,
              "load_average": os.getloadavg(), "environment": capture(),
              "sizes": {size: measure(size, args.thresholds, args) for size in args.sizes}}
    result["load_average_after"] = os.getloadavg()
    out = Path(args.out or ROOT / "results" / f"prefill-gap-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for size, doc in result["sizes"].items():
        for threshold, row in doc["thresholds"].items():
            print(f"{size} ({doc['prompt_tokens']}-token prompt, budget {doc['token_budget']}), "
                  f"threshold {threshold}: longest gap {row['max_gap_ms_median']:.0f} ms "
                  f"(steps {row['step_ms_before_median']:.0f} ms before), TTFT "
                  f"{row['ttft_s_median']:.2f} s")
    print(out)


if __name__ == "__main__":
    main()
