"""Per-step cost of the logits processors (engine/executor/logits_processors.py) over a
synthetic ``--vocab-size`` vocabulary (Qwen2.5's 152064 by default), at each batch size of
``--rows`` (1 and 8 by default), in three cases:

- ``none``: no row asks for any processor (the call returns the logits as they are);
- ``penalties``: presence, frequency and repetition penalties on every row;
- ``all``: those plus a logit_bias of 300 entries, 8 bad words and min_tokens.

and the sampler after them (engine/executor/sampler.py: temperature, min_p, top-k, top-p and
the draw; scripts/sampler_bench.py sets it beside the per-row sampler) in the cases of
:data:`SAMPLER_CASES`, ``--sampler-steps`` steps each, so the processors' cost can be read
beside the rest of choosing a token.

Each row has a ``--prompt-tokens`` prompt (distinct ids: the repetition penalty's work) and
``--history`` tokens already generated before the timed steps; each of the ``--steps`` steps
accepts one more token per row, as decoding does. Writes
``results/logits-processors-<UTC time>.json`` (``--label`` names the run, e.g. before/after
a change) and prints milliseconds per step (median and max).

    .venv/bin/python scripts/penalties_bench.py --rows 1 8 --steps 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

from aphrodite_cli.bench.results.environment import git_revision

ROOT = Path(__file__).resolve().parents[1]
CASES = ("none", "penalties", "all")
SAMPLER_CASES = {"greedy": dict(temperature=0), "temperature": dict(temperature=1.0),
                 "seeded": dict(temperature=1.0, seed=1),
                 "min_p": dict(temperature=0.7, min_p=0.05),
                 "top_k": dict(temperature=0.7, top_k=50),
                 "top_p": dict(temperature=0.7, top_p=0.9)}


class _Tokenizer:
    """Bad words as fixed two-token sequences (no real tokenizer needed for the cost)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(text) * 7 % 1000, len(text) * 13 % 1000]


def _params(case: str, vocab: int) -> dict:
    if case == "none":
        return {}
    out = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    if case == "all":
        out.update(logit_bias={i * 97 % vocab: 1.0 for i in range(300)},
                   bad_words=[f"w{'x' * i}" for i in range(8)], min_tokens=4)
    return out


def _token(step: int, row: int, vocab: int) -> int:
    # a few hundred distinct ids per row, repeating: counts above 1, as text has
    return (step * 31 % 397 + row * 1009) % vocab


def _rows(n: int, vocab: int, case: str, prompt_tokens: int, history: int) -> list:
    from engine import SamplingParams

    stride = max(vocab // max(prompt_tokens, 1), 1)
    prompt = SimpleNamespace(input_ids=list(range(0, vocab, stride))[:prompt_tokens])
    return [SimpleNamespace(done=False, logits_state=None,
                            token_ids=[_token(s, i, vocab) for s in range(history)],
                            request=SimpleNamespace(params=SamplingParams(
                                max_tokens=4096, logprobs=None, **_params(case, vocab)),
                                prompt=prompt))
            for i in range(n)]


def time_steps(rows: list, vocab: int, steps: int, device: str) -> list[float]:
    import torch

    from engine.executor import logits_processors

    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(len(rows), vocab, generator=generator).to(device)
    out = []
    for step in range(steps):
        logits = raw.clone()  # (the processors may work in place: a fresh step's logits)
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits_processors.apply(rows, logits, _Tokenizer(), [2])
        if device != "cpu":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
        for i, row in enumerate(rows):
            row.token_ids.append(_token(len(row.token_ids) + step, i, vocab))
    return out


def time_sampler(n: int, vocab: int, params: dict, steps: int, device: str) -> list[float]:
    import torch

    from engine import SamplingParams
    from engine.executor import sampler

    rows = [SimpleNamespace(done=False, request=SimpleNamespace(params=SamplingParams(
        max_tokens=16, **{**params, **({"seed": params["seed"] + i} if "seed" in params
                                       else {})})),
        generator=sampler.seeded_generator(params["seed"] + i) if "seed" in params else None)
        for i in range(n)]
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        sampler.sample(rows, logits)
        out.append(time.perf_counter() - start)
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocab-size", type=int, default=152064)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--history", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sampler-steps", type=int, default=10,
                        help="steps per sampler case (0: leave the sampler out)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--label", default="", help="a name for this run (before, after...)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {"kind": "logits-processors", "label": args.label,
                    "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
                    "git_revision": git_revision(), "vocab_size": args.vocab_size,
                    "prompt_tokens": args.prompt_tokens, "history": args.history,
                    "steps": args.steps, "device": args.device, "threads": args.threads,
                    "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "runs": []}
    for n in args.rows:
        for case in CASES:
            rows = _rows(n, args.vocab_size, case, args.prompt_tokens, args.history)
            times = time_steps(rows, args.vocab_size, args.steps, args.device)
            times = times[5:]  # (the first steps build each row's state)
            run = {"rows": n, "case": case,
                   "ms_p50": round(statistics.median(times) * 1e3, 3),
                   "ms_max": round(max(times) * 1e3, 3)}
            result["runs"].append(run)
            print(f"rows={n:<3} {case:<10} {run['ms_p50']:8.3f} ms/step (max "
                  f"{run['ms_max']:.3f})")
    result["sampler"] = []
    for n in args.rows if args.sampler_steps > 0 else ():
        for case, params in SAMPLER_CASES.items():
            times = time_sampler(n, args.vocab_size, params, args.sampler_steps + 1,
                                 args.device)[1:]
            run = {"rows": n, "case": case,
                   "ms_p50": round(statistics.median(times) * 1e3, 3),
                   "ms_max": round(max(times) * 1e3, 3)}
            result["sampler"].append(run)
            print(f"rows={n:<3} sampler {case:<12} {run['ms_p50']:8.3f} ms/step (max "
                  f"{run['ms_max']:.3f})")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = ROOT / "results" / f"logits-processors-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("->", out)


if __name__ == "__main__":
    main()
