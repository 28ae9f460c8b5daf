"""Measure what engine/models/cpu_linear.py buys on this machine: float32 linear layers through
PyTorch's default (MKL sgemm) and through oneDNN with a packed weight, at the shapes of a
prefill, a vision encoder and decode steps, then a whole model's encoder and prefill (a
random-weight Qwen2.5-VL, ``--size``) with the packing on and off, interleaved, in this
process. Writes ``results/cpu-linear-<date>.json`` and prints a table.

    .venv/bin/python scripts/cpu_linear_bench.py --threads 1 --size small --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layers(repeats: int) -> list[dict]:
    out = []
    for rows, k, n in [(1, 512, 1536), (8, 512, 1536), (64, 512, 1536), (512, 512, 1536),
                       (2048, 640, 1710), (4096, 640, 1920)]:
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        plain = _time(lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b), repeats * 5)
        dnn = _time(lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(
            x, p, b, "none", [], ""), repeats * 5)
        flops = 2 * rows * k * n
        out.append({"rows": rows, "in": k, "out": n, "mkl_gflops": flops / plain / 1e9,
                    "onednn_gflops": flops / dnn / 1e9, "speedup": plain / dnn})
    return out


def model(size: str, repeats: int) -> dict:
    from aphrodite_cli.bench.harness import synthetic
    from engine.llm import LLM
    from engine.processing import device_normalize
    from engine.processing.preprocess import MediaItem

    folder = Path.home() / ".cache" / "aphrodite" / "peer-vllm" / "models" / size
    llm = LLM(str(folder) if folder.exists() else None, num_threads=torch.get_num_threads())
    items = [MediaItem("image", decoded=synthetic.image_array(1280, 720, 1)),
             MediaItem("video", decoded=np.stack([synthetic.video_frame(i, 320, 240)
                                                  for i in range(16)]))]
    spec = llm.loaded.spec
    model = llm.engine.runner.model
    runner = llm.engine.runner
    rows = {}
    for item in items:
        prompt = llm.prepare("Look: " + spec.placeholders[item.modality] + " Describe it.",
                             [item], None, False)[1]
        ids = torch.tensor([prompt.input_ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  **device_normalize.apply(prompt.mm, runner.normalizers)}
        linears = [m for m in model.modules() if "forward" in m.__dict__
                   and isinstance(m, torch.nn.Linear)]
        saved = {m: m.__dict__["forward"] for m in linears}

        def run(inputs=inputs):
            with torch.inference_mode():
                model(**inputs, logits_to_keep=1)

        on, off = [], []
        for _ in range(repeats):  # interleaved: the machine's noise hits both alike
            on.append(_time(run, 1))
            for m in linears:
                del m.__dict__["forward"]
            off.append(_time(run, 1))
            for m, forward in saved.items():
                m.forward = forward
        rows[item.modality] = {"prompt_tokens": len(prompt.input_ids),
                               "packed_s": statistics.median(on),
                               "plain_s": statistics.median(off),
                               "speedup": statistics.median(off) / statistics.median(on),
                               "packed_layers": len(linears)}
    llm.close()
    return {"model": str(folder if folder.exists() else "tiny"), "forward": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", default="small", help="tiny|small|medium (peer cache)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"kind": "cpu-linear", "created_utc": datetime.now(UTC).isoformat(),
              "cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "torch": torch.__version__, "layers": layers(args.repeats),
              "model": model(args.size, args.repeats)}
    out = Path(args.out or ROOT / "results" / f"cpu-linear-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for row in result["layers"]:
        print(f"{row['rows']:5} x {row['in']:4} -> {row['out']:5}: MKL {row['mkl_gflops']:6.1f}"
              f"  oneDNN {row['onednn_gflops']:6.1f} GFLOPS  ({row['speedup']:.2f}x)")
    for name, row in result["model"]["forward"].items():
        print(f"{name} prompt ({row['prompt_tokens']} tokens) encoder + prefill: plain "
              f"{row['plain_s'] * 1000:.0f} ms, packed {row['packed_s'] * 1000:.0f} ms "
              f"({row['speedup']:.2f}x)")
    print(out)


if __name__ == "__main__":
    main()
