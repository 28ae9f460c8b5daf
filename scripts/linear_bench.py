"""Measure what the decode step's linear kernel (engine/models/decode_kernels.py,
csrc/decode_linear.c) buys on this machine: every linear product of a decode step of the peer
models (Qwen2.5-VL small: 8 layers of 512 wide, MLP 1536; medium: 16 of 768, MLP 2304; q/k/v
and gate/up fused as the lean step runs them), one pass over all of a model's weights (far
more than the caches hold) per timed call, through PyTorch's product (MKL), oneDNN's packed
product and the kernel, beside a plain read of the same bytes, and the same weights as int8
rows (``--quantization int8``) through PyTorch's int8 product (engine/models/int8_linear.py)
and through the kernel's int8 panels, interleaved, in this process, at 1-64 rows. Prints GB/s
of float32 weights per product (for int8: the float32 bytes the same product stands for, so
the columns compare times) and writes ``results/linear-<date>.json``.

    .venv/bin/python scripts/linear_bench.py --threads 1 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch
from cpu_linear_bench import _time  # (this folder: the script's own)

from engine.models import decode_kernels, int8_linear

ROOT = Path(__file__).resolve().parents[1]
#: (hidden, MLP width, layers, q/k/v width) of the peer models' text decoders
MODELS = {"small": (512, 1536, 8, 768), "medium": (768, 2304, 16, 1280)}


def model(name: str, rows_list: list[int], repeats: int) -> list[dict]:
    hidden, width, layers, qkv = MODELS[name]
    shapes = [s for _ in range(layers)
              for s in ((qkv, hidden), (hidden, hidden), (2 * width, hidden), (hidden, width))]
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    total = sum(w.numel() * 4 for w in weights)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    kernels = [decode_kernels.linear(w, None) for w in weights]
    onednn = torch.ops.mkldnn._linear_pointwise.default
    quantized = [int8_linear.quantize_rows(w) for w in weights]
    int8_kernels = [decode_kernels.linear_int8(q, s, None, lambda x: None) for q, s in quantized]
    out = []
    for rows in rows_list:
        xs = [torch.randn(rows, 1, k) for _, k in shapes]
        for w, x, product in zip(weights, xs, kernels, strict=True):  # (each checked against MKL's)
            torch.testing.assert_close(product(x), torch.nn.functional.linear(x, w),
                                       atol=1e-4, rtol=1e-4)
        runs = {
            "read": lambda: [w.sum() for w in weights],
            "mkl": lambda xs=xs: [torch.nn.functional.linear(x, w)
                                  for w, x in zip(weights, xs, strict=True)],
            "onednn": lambda xs=xs: [onednn(x, p, None, "none", [], "")
                                     for p, x in zip(packed, xs, strict=True)],
            "kernel": lambda xs=xs: [f(x) for f, x in zip(kernels, xs, strict=True)],
            "int8_torch": lambda xs=xs: [int8_linear.product(x, q, s, None)
                                         for (q, s), x in zip(quantized, xs, strict=True)],
            "int8_kernel": lambda xs=xs: [f(x) for f, x in zip(int8_kernels, xs, strict=True)],
        }
        seconds = {key: _time(fn, repeats) for key, fn in runs.items()}
        row = {"model": name, "rows": rows, "weight_mb": total / 1e6,
               **{f"{key}_ms": s * 1e3 for key, s in seconds.items()},
               **{f"{key}_gb_s": total / s / 1e9 for key, s in seconds.items()}}
        out.append(row)
        print(f"{name:6} rows {rows:3}  " + "  ".join(
            f"{key} {row[f'{key}_gb_s']:5.1f} GB/s" for key in runs), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--models", default="small,medium")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if decode_kernels.prepare() is None or decode_kernels.linear(torch.zeros(512, 512),
                                                                 None) is None:
        raise SystemExit("the linear kernel is not available here (see the log)")
    rows = [int(r) for r in args.rows.split(",")]
    results = [r for name in args.models.split(",") for r in model(name, rows, args.repeats)]
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = ROOT / "results" / f"linear-{stamp}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"threads": args.threads, "machine": platform.processor() or
                                platform.machine(), "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
