"""Measure what engine/models/attention.py buys on this machine: one decode step's attention
(one query per row) through transformers' SDPA over the whole left-padded frame, through the
engine's batched products (each row over its own columns when the padding is large, else two
grouped products over the frame) and through its C kernel (engine/models/decode_kernels.py,
each kept key and value read once), beside a plain read of the rows' keys and values (a sum:
the least a pass over them costs), at the
shapes of the peer models (8 rows; Qwen2.5-VL small: 8 query heads over 2 key/value heads,
medium: 12 over 4; keys and values strided in a cache reserved ahead, as the running batch
keeps them; the caches flushed before each call, as the layer's weights do in a decode step),
interleaved, in this process, each result checked against SDPA's. Writes
``results/attention-<date>.json`` and prints a table.

    .venv/bin/python scripts/attention_bench.py --threads 1 --repeats 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.models import attention, decode_kernels

ROOT = Path(__file__).resolve().parents[1]


class _Module:
    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.is_causal = True


_FLUSH = torch.empty(64 << 20, dtype=torch.uint8)


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn``, each call after 64 MB have gone through the caches (in a
    decode step the layer's weights push the keys and values out before its attention)."""
    fn()
    times = []
    for _ in range(repeats):
        _FLUSH.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(heads: int, kv_heads: int, lengths: list[int], repeats: int) -> dict:
    rows, width, dim = len(lengths), max(lengths), 64
    q = torch.randn(rows, heads, 1, dim)
    reserved = width + width // 4  # the running batch reserves columns ahead
    k = torch.randn(rows, kv_heads, reserved, dim)[:, :, :width]
    v = torch.randn(rows, kv_heads, reserved, dim)[:, :, :width]
    mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, ..., width - n:] = True
    module = _Module(heads // kv_heads)
    expected = sdpa_attention_forward(module, q, k, v, mask)[0]
    torch.testing.assert_close(attention.attention(module, q, k, v, mask)[0], expected,
                               atol=1e-5, rtol=1e-5)
    lib = decode_kernels.prepare()
    kernel = lib is not None

    def batched() -> None:  # the engine's attention without its kernel
        decode_kernels._state["lib"] = None
        try:
            attention.attention(module, q, k, v, mask)
        finally:
            decode_kernels._state["lib"] = lib

    keep = mask[:, 0, 0, :]
    times = {"sdpa": 0.0, "engine": 0.0, "kernel": 0.0, "read": 0.0}
    calls = {"sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask), "engine": batched,
             "kernel": lambda: decode_kernels.decode_attention(q, k, v, keep, dim ** -0.5),
             "read": lambda: (k.sum(), v.sum())}
    if not kernel:
        del calls["kernel"]
    for _ in range(3):  # interleaved
        for name, fn in calls.items():
            times[name] += _time(fn, repeats) / 3
    out = {"heads": heads, "kv_heads": kv_heads, "lengths": lengths,
           "sdpa_ms": round(times["sdpa"] * 1e3, 4), "engine_ms": round(times["engine"] * 1e3, 4),
           "read_ms": round(times["read"] * 1e3, 4),
           "speedup": round(times["sdpa"] / times["engine"], 2)}
    if kernel:
        torch.testing.assert_close(decode_kernels.decode_attention(q, k, v, keep, dim ** -0.5),
                                   expected, atol=1e-5, rtol=1e-5)
        out.update(kernel_ms=round(times["kernel"] * 1e3, 4),
                   kernel_speedup=round(times["engine"] / times["kernel"], 2),
                   kernel_over_read=round(times["kernel"] / times["read"], 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(8, 2, [415 + 2 * i for i in range(8)]), (8, 2, [1000] * 8),
              (12, 4, [500 + 3 * i for i in range(8)]), (8, 2, [800] * 2 + [250] * 6),
              (12, 4, [1600] * 2 + [250] * 6)]
    results = [case(h, kv, lengths, args.repeats) for h, kv, lengths in shapes]
    print(f"{'heads':>5} {'kv':>3} {'rows x columns':>22} {'SDPA ms':>9} {'engine ms':>9} "
          f"{'speed-up':>8} {'kernel ms':>9} {'vs engine':>9} {'read ms':>8} {'vs read':>7}")
    for r in results:
        lengths = r["lengths"]
        shape = f"{len(lengths)} x {min(lengths)}-{max(lengths)}"
        kernel = (f"{r['kernel_ms']:>9.3f} {r['kernel_speedup']:>8.2f}x" if "kernel_ms" in r
                  else f"{'-':>9} {'-':>9}")
        over = f"{r['kernel_over_read']:>6.2f}x" if "kernel_ms" in r else f"{'-':>7}"
        print(f"{r['heads']:>5} {r['kv_heads']:>3} {shape:>22} {r['sdpa_ms']:>9.3f} "
              f"{r['engine_ms']:>9.3f} {r['speedup']:>7.2f}x {kernel} {r['read_ms']:>8.3f} "
              f"{over}")
    out = args.out or ROOT / "results" / f"attention-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "torch": torch.__version__,
                               "machine": platform.platform(), "cases": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
