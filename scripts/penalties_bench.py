"""Per-step cost of the logits processors (engine/executor/logits_processors.py): a batch of
``--rows`` rows over a synthetic ``--vocab-size`` vocabulary (Qwen2.5's 152064 by default),
each with presence, frequency and repetition penalties, a logit_bias of 300 entries, 8 bad
words and min_tokens, stepped ``--steps`` times (each step one more accepted token per row,
as in decoding), against the same rows with none (the call then returns the logits as they
are). Writes ``results/logits-processors-<date>.json`` and prints milliseconds per step.

    .venv/bin/python scripts/penalties_bench.py --rows 8 --steps 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


class _Tokenizer:
    """Bad words as fixed two-token sequences (no real tokenizer needed for the cost)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(text) * 7 % 1000, len(text) * 13 % 1000]


def _rows(n: int, vocab: int, processed: bool) -> list:
    from engine import SamplingParams

    extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                 logit_bias={i * 97 % vocab: 1.0 for i in range(300)},
                 bad_words=[f"w{'x' * i}" for i in range(8)], min_tokens=4) if processed else {}
    prompt = SimpleNamespace(input_ids=list(range(0, vocab, max(vocab // 512, 1))))
    return [SimpleNamespace(done=False, logits_state=None, token_ids=[],
                            request=SimpleNamespace(params=SamplingParams(
                                max_tokens=4096, **extra), prompt=prompt))
            for _ in range(n)]


def time_steps(rows: list, vocab: int, steps: int, device: str) -> list[float]:
    import torch

    from engine.executor import logits_processors

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows), vocab, generator=generator).to(device)
    out = []
    for step in range(steps):
        start = time.perf_counter()
        logits_processors.apply(rows, logits, _Tokenizer(), [2])
        if device != "cpu":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
        for i, row in enumerate(rows):
            row.token_ids.append((step * 31 + i) % vocab)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=152064)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    result = {"rows": args.rows, "vocab_size": args.vocab_size, "steps": args.steps,
              "device": args.device, "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine()}
    for name, processed in (("none", False), ("all", True)):
        times = time_steps(_rows(args.rows, args.vocab_size, processed), args.vocab_size,
                           args.steps, args.device)[5:]  # (the first steps build the state)
        result[f"{name}_ms_p50"] = round(statistics.median(times) * 1e3, 3)
        result[f"{name}_ms_max"] = round(max(times) * 1e3, 3)
    out = ROOT / "results" / f"logits-processors-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result), "->", out)


if __name__ == "__main__":
    main()
