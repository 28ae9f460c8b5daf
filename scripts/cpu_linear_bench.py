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

from engine import envs
from engine.models import cpu_linear

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
    for rows, k, n in [(8, 32, 64), (8, 128, 256), (1024, 128, 256), (8, 512, 512),
                       (1024, 512, 512), (8, 1024, 512), (1024, 1024, 512),
                       (1, 512, 1536), (8, 512, 1536), (64, 512, 1536), (512, 512, 1536),
                       (2048, 640, 1710), (4096, 640, 1920)]:
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        plain = _time(lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b), repeats * 5)
        dnn = _time(lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(
            x, p, b, "none", [], ""), repeats * 5)
        flops = 2 * rows * k * n
        out.append({"rows": rows, "in": k, "out": n, "mkl_gflops": flops / plain / 1e9,
                    "onednn_gflops": flops / dnn / 1e9, "speedup": plain / dnn,
                    "mkl_us": plain * 1e6, "onednn_us": dnn * 1e6,
                    "packed_by_default": k * n >= envs.APHRODITE_CPU_ONEDNN_MIN_WEIGHT})
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
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        default = {m: m.__dict__["forward"] for m in linears if "forward" in m.__dict__}
        for m in linears:
            m.__dict__.pop("forward", None)
        cpu_linear.pack_linears(model, min_weight=0)
        every = {m: m.__dict__["forward"] for m in linears if "forward" in m.__dict__}

        def run(inputs=inputs):
            with torch.inference_mode():
                model(**inputs, logits_to_keep=1)

        def use(forwards, linears=linears):
            for m in linears:
                m.__dict__.pop("forward", None)
            for m, forward in forwards.items():
                m.forward = forward

        times: dict[str, list[float]] = {"default": [], "all": [], "none": []}
        variants = {"default": default, "all": every, "none": {}}
        for _ in range(repeats):  # interleaved: the machine's noise hits all alike
            for name, forwards in variants.items():
                use(forwards)
                times[name].append(_time(run, 1))
        use(default)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows[item.modality] = {"prompt_tokens": len(prompt.input_ids),
                               "packed_s": med["default"], "all_packed_s": med["all"],
                               "plain_s": med["none"], "speedup": med["none"] / med["default"],
                               "packed_layers": len(default), "linear_layers": len(linears)}
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
        print(f"{row['rows']:5} x {row['in']:4} -> {row['out']:5}: MKL {row['mkl_us']:8.1f} us,"
              f" oneDNN {row['onednn_us']:8.1f} us ({row['speedup']:.2f}x)"
              f"{'  packed by default' if row['packed_by_default'] else ''}")
    for name, row in result["model"]["forward"].items():
        print(f"{name} prompt ({row['prompt_tokens']} tokens) encoder + prefill: plain "
              f"{row['plain_s'] * 1000:.0f} ms, every layer packed "
              f"{row['all_packed_s'] * 1000:.0f} ms, as loaded ({row['packed_layers']} of "
              f"{row['linear_layers']} packed) {row['packed_s'] * 1000:.0f} ms")
    print(out)


if __name__ == "__main__":
    main()
