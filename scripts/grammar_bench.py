"""Decode cost of structured outputs: a batch of 8 rows with a grammar (a JSON schema) against
the same batch without, in milliseconds per decode step, on the same engine in this process
(the two interleaved, ``--repeats`` times each). Only steps that ran all 8 rows count; the
rows ignore the end token and the constrained rows' schema never completes before
``--max-tokens`` (an array of numbers without bound), so both run the same steps. The tiny
model's vocabulary is 449 tokens, so its masks cost little: ``--vocab-size`` also times the
grammar's part of a step alone (the 8 rows' masks filled, then applied to float32 logits on
the CPU) over a synthetic vocabulary of that many tokens (Qwen2.5's 152064 by default; 0
skips it). Writes ``results/grammar-decode-<date>.json`` and prints the ratio.

    .venv/bin/python scripts/grammar_bench.py --model tiny:qwen2_5_vl --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8
#: never complete within --max-tokens: at least 500 numbers (the model picks any, any length)
SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {
    "type": "number"}, "minItems": 500}}, "required": ["values"]}


def run(llm, structured: bool, max_tokens: int) -> list[float]:
    """The durations (s) of the decode steps that ran all the rows."""
    from engine import SamplingParams

    runner = llm.engine.runner
    steps: list[float] = []
    decode = runner.decode

    def timed(batch) -> None:
        start = time.perf_counter()
        decode(batch)
        if len(batch.rows) == ROWS:
            steps.append(time.perf_counter() - start)

    runner.decode = timed
    try:
        params = SamplingParams(max_tokens=max_tokens, n=ROWS, seed=0, ignore_eos=True,
                                structured_outputs={"json": SCHEMA} if structured else None)
        llm.generate("Numbers as JSON:", params)
    finally:
        runner.decode = decode
    return steps


def synthetic_mask_ms(vocab_size: int, steps: int = 60) -> dict[str, float]:
    """Median ms per step to fill :data:`ROWS` rows' masks and to apply them, over a
    synthetic byte vocabulary of ``vocab_size`` tokens (random words of 2-9 characters)."""
    import random

    import torch
    import xgrammar as xgr

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,.-_"
    vocab = [bytes([i]) for i in range(256)]
    seen = set(vocab)
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))).encode()
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    vocab.append(b"<eos>")
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False) \
        .compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    bitmask = xgr.allocate_token_bitmask(ROWS, vocab_size)
    logits = torch.randn(ROWS, vocab_size)
    generator = torch.Generator().manual_seed(0)
    fills, applies = [], []
    for _ in range(steps):
        start = time.perf_counter()
        for i, matcher in enumerate(matchers):
            if matcher.is_terminated():  # (a row whose JSON ended starts again)
                matcher.reset()
            matcher.fill_next_token_bitmask(bitmask, i)
        filled = time.perf_counter()
        masked = logits.clone()
        applying = time.perf_counter()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab_size,
                                        indices=list(range(ROWS)), backend="cpu")
        fills.append(filled - start)
        applies.append(time.perf_counter() - applying)
        tokens = torch.multinomial(torch.softmax(masked, -1), 1, generator=generator)
        for matcher, token in zip(matchers, tokens[:, 0].tolist(), strict=True):
            matcher.accept_token(token)
    return {"vocab_size": vocab_size,
            "fill_ms_per_step": round(statistics.median(fills) * 1e3, 3),
            "apply_ms_per_step": round(statistics.median(applies) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2_5_vl")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=152064)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from importlib.metadata import version

    import torch

    from engine import LLM

    llm = LLM(args.model, max_num_seqs=ROWS, num_threads=args.num_threads,
              enable_prefix_caching=False)
    run(llm, True, 8)  # warm both paths up (the grammar compiled once)
    run(llm, False, 8)
    plain: list[float] = []
    constrained: list[float] = []
    for _ in range(args.repeats):
        plain += run(llm, False, args.max_tokens)
        constrained += run(llm, True, args.max_tokens)
    llm.close()
    plain_ms = statistics.median(plain) * 1e3
    constrained_ms = statistics.median(constrained) * 1e3
    result = {
        "kind": "grammar-decode", "model": args.model, "rows": ROWS,
        "max_tokens": args.max_tokens, "repeats": args.repeats,
        "num_threads": args.num_threads, "steps": {"plain": len(plain),
                                                   "constrained": len(constrained)},
        "plain_ms_per_step": round(plain_ms, 3),
        "constrained_ms_per_step": round(constrained_ms, 3),
        "ratio": round(constrained_ms / plain_ms, 3),
        "synthetic_vocab": synthetic_mask_ms(args.vocab_size) if args.vocab_size else None,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "xgrammar": version("xgrammar"),
                        "machine": platform.machine(), "processor": platform.processor()},
        "date": datetime.now().isoformat(timespec="seconds"),
    }
    out = Path(args.out or ROOT / "results" / f"grammar-decode-{datetime.now():%Y%m%d-%H%M%S}"
                                               ".json")
    out.write_text(json.dumps(result, indent=2))
    print(f"{ROWS} rows, {args.model}: {plain_ms:.2f} ms per step without a grammar, "
          f"{constrained_ms:.2f} ms with: {constrained_ms / plain_ms:.2f}x ({out})")
    if result["synthetic_vocab"]:
        print(f"{args.vocab_size}-token vocabulary: {ROWS} masks filled in "
              f"{result['synthetic_vocab']['fill_ms_per_step']:.2f} ms, applied in "
              f"{result['synthetic_vocab']['apply_ms_per_step']:.2f} ms per step")


if __name__ == "__main__":
    main()
