"""Per-step cost of the sampler (engine/executor/sampler.py) over a synthetic
``--vocab-size`` vocabulary (Qwen2.5's 152064 by default), at each batch size of ``--rows``
(1 and 8 by default): ``sample`` (the rows of a step together, in chunks that fit
``CPU_CHUNK_BYTES``) beside ``one_chunk`` (the same with every row in one chunk: what the
chunk size saves) and ``per_row`` (``sample_per_row``, one row at a time: the reference it
is held to, and the sampler before it), the three interleaved step by step so a busy
machine slows them alike, in the cases of :data:`CASES`
(every row alike) and ``mixed`` (a batch of all of them: greedy, unseeded and seeded rows
with each filter).

Writes ``results/sampler-<UTC time>.json`` (``--label`` names the run) and prints
milliseconds per step (median and minimum) and the ratios per_row/sample and
one_chunk/sample of the medians.

    .venv/bin/python scripts/sampler_bench.py --rows 1 8 --steps 40
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
CASES = {"greedy": dict(temperature=0), "temperature": dict(temperature=1.0),
         "seeded": dict(temperature=1.0, seed=1),
         "min_p": dict(temperature=0.7, min_p=0.05),
         "top_k": dict(temperature=0.7, top_k=50),
         "top_p": dict(temperature=0.7, top_p=0.9),
         "all_filters": dict(temperature=0.8, top_k=200, min_p=0.01, top_p=0.95, seed=3)}


def _rows(n: int, case: str) -> list:
    from engine import SamplingParams
    from engine.executor import sampler

    kinds = list(CASES.values())
    out = []
    for i in range(n):
        params = dict(kinds[i % len(kinds)] if case == "mixed" else CASES[case])
        if "seed" in params:
            params["seed"] += i
        out.append(SimpleNamespace(
            done=False, request=SimpleNamespace(params=SamplingParams(max_tokens=16, **params)),
            generator=sampler.seeded_generator(params["seed"]) if "seed" in params else None))
    return out


def time_case(n: int, vocab: int, case: str, steps: int) -> dict:
    import torch

    from engine.executor import sampler

    def one_chunk(rows: list, logits: object) -> list[int]:
        chunk, sampler.CPU_CHUNK_BYTES = sampler.CPU_CHUNK_BYTES, 1 << 62
        try:
            return sampler.sample(rows, logits)
        finally:
            sampler.CPU_CHUNK_BYTES = chunk

    fns = {"sample": sampler.sample, "one_chunk": one_chunk, "per_row": sampler.sample_per_row}
    rows = {name: _rows(n, case) for name in fns}
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    times: dict[str, list[float]] = {name: [] for name in fns}
    for step in range(steps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(rows[name], logits)
            if step:  # (the first builds the allocator's pools)
                times[name].append(time.perf_counter() - start)
    out: dict = {"rows": n, "case": case}
    for name, ts in times.items():
        out[f"{name}_ms_p50"] = round(statistics.median(ts) * 1e3, 3)
        out[f"{name}_ms_min"] = round(min(ts) * 1e3, 3)
    for name in ("per_row", "one_chunk"):
        out[f"{name}_over_sample"] = round(out[f"{name}_ms_p50"] / out["sample_ms_p50"], 2)
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocab-size", type=int, default=152064)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--label", default="", help="a name for this run")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {"kind": "sampler", "label": args.label,
                    "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
                    "git_revision": git_revision(), "vocab_size": args.vocab_size,
                    "steps": args.steps, "threads": args.threads, "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "runs": []}
    for n in args.rows:
        for case in [*CASES, "mixed"]:
            run = time_case(n, args.vocab_size, case, args.steps)
            result["runs"].append(run)
            print(f"rows={n:<3} {case:<12}" + "".join(
                f"  {name} {run[name + '_ms_p50']:7.3f} (min {run[name + '_ms_min']:.3f})"
                for name in ("sample", "one_chunk", "per_row")) + " ms; per_row/sample "
                f"x{run['per_row_over_sample']}, one_chunk/sample x{run['one_chunk_over_sample']}")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = ROOT / "results" / f"sampler-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("->", out)


if __name__ == "__main__":
    main()
