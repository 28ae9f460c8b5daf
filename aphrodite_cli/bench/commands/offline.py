"""``aphrodite bench video-decode``, ``mm-processor``, ``batching`` and ``decode-step``: the
offline benchmarks (no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.config_flags import choices_metavar
from aphrodite_cli.options import (
    OUTPUT_FORMAT_HELP,
    BatchingWorkload,
    MediaDelivery,
    Mode,
    ModelSizeName,
    OutputFormat,
)
from aphrodite_cli.output import err, out, print_table
from engine.config import QUANTIZATIONS
from engine.media.video.options import parse_backend_choices
from engine.media.video.sampling import DEFAULT_NUM_FRAMES

DEFAULT_BACKENDS = \
    "opencv,pyav,pyav:isolation=process,pyav:skip_nonref=false,torchcodec,deepstream"


#: ``aphrodite bench video-decode --help``'s epilog.
VIDEO_DECODE_EXAMPLES = """Examples:

  aphrodite bench video-decode                      # the standard 10 s 1080p30 H.264 clip

  aphrodite bench video-decode clip.mp4 --backends pyav,torchcodec:seek_mode=approximate

Backend options follow the name: NAME:KEY=VALUE:KEY=VALUE. isolation=process runs the decode
in a decode worker process, as `serve --decode-isolation process` does (frames handed back
through shared memory), so the row beside the plain one is the isolation's overhead."""


def video_decode(
    clip: Annotated[Path | None, typer.Argument(help="Video file; default: the standard clip, "
                                                "generated once into the cache.")] = None,
    backends: Annotated[str, typer.Option(help="Comma-separated backends with options.")
                        ] = DEFAULT_BACKENDS,
    num_frames: Annotated[int, typer.Option(
        min=1, help="Frames sampled per decode (as the server samples a video by default).")
    ] = DEFAULT_NUM_FRAMES,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats of everything.")] = 5,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the result JSON goes.")
                       ] = Path("results"),
) -> None:
    """Time sampled decoding per backend against a full ffmpeg decode of the same clip."""
    from aphrodite_cli.bench.offline import video_decode as runner
    from aphrodite_cli.bench.results.files import write_result

    path = clip or runner.standard_clip()
    choices = parse_backend_choices(backends, flag="--backends")
    doc = runner.run(path, [(c.pop("backend"), c) for c in choices], num_frames=num_frames,
                     repeats=repeats, progress=lambda msg: out.print(f"  {msg}", markup=False))
    result = write_result(doc, "video-decode", out_dir)
    _print_table(doc)
    out.print(f"result: {result}", markup=False)


def _print_table(doc: dict) -> None:
    from rich.table import Table

    clip = doc["clip"]
    table = Table(title=f"{clip['width']}x{clip['height']} {clip['codec']}, {clip['frames']} "
                  f"frames {clip['frame_types']}, {doc['num_frames']} sampled")
    for col in ("backend", "options", "median s", "x full decode", "frames exact", "error"):
        table.add_column(col)
    ref = doc["reference"]
    if ref["median_s"] is not None:
        table.add_row("ffmpeg (full decode)", "-threads 2", f"{ref['median_s']:.3f}", "1.00",
                      "", "")
    for b in doc["backends"]:
        ratio = b["ratio_to_full_decode"]
        table.add_row(b["backend"], json.dumps(b["options"]) if b["options"] else "",
                      f"{b['median_s']:.3f}" if b["median_s"] is not None else "-",
                      f"{ratio:.2f}" if ratio is not None else "-",
                      {True: "yes", None: "-",
                       False: f"no (mean diff {b['mean_abs_diff']})"}[b["identical_to_exact"]],
                      (b["error"] or "")[:60])
    out.print(table)


#: ``aphrodite bench mm-processor --help``'s epilog.
MM_PROCESSOR_EXAMPLES = """Examples:

  aphrodite bench mm-processor                       # 1280x720 JPEGs on the tiny Qwen2.5-VL

  aphrodite bench mm-processor --bucket-config '{"720,1280,1": 0.6, "360,640,16": 0.4}'
  --items-per-request 2 --video-backends opencv,pyav,torchcodec

  aphrodite bench mm-processor --model /models/qwen2.5-vl-7b --num-prompts 50

  aphrodite bench mm-processor --no-encoder  # two real processors, same media, no weights
  --compare-models Qwen/Qwen2.5-VL-3B-Instruct,Qwen/Qwen3-VL-4B-Instruct"""


def mm_processor(
    model: Annotated[str | None, typer.Option(help="Model folder, hub id or tiny:ARCH (with "
                                                "--no-encoder a hub model's weights are not "
                                                "downloaded); "
                                              "default: the embedded tiny Qwen2.5-VL.")] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 30,
    bucket_config: Annotated[str | None, typer.Option(
        metavar="JSON", help='"height,width,frames": probability (default 1280x720 images).')
    ] = '{"720,1280,1": 1}',
    items_per_request: Annotated[int, typer.Option(min=1)] = 1,
    media_delivery: Annotated[MediaDelivery, typer.Option(
        help="data-url, or http (a loopback media server: adds a real download).")
    ] = "data-url",
    mode: Annotated[Mode, typer.Option(help="cold, warm or both")] = "both",
    encoder: Annotated[bool, typer.Option(help="Also time the vision/audio encoder.")] = True,
    dataset_path: Annotated[Path | None, typer.Option(
        help="A JSONL dataset (as for bench serve) instead of random-mm.")] = None,
    media_dir: Annotated[Path | None, typer.Option(help="Folder for media paths in JSONL.")
                         ] = None,
    video_backends: Annotated[str | None, typer.Option(
        help="Also decode the same videos with each of these backends, e.g. "
             "opencv,pyav:threads=2,torchcodec:seek_mode=approximate (NAME:KEY=VALUE, as "
             "everywhere).")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    compare_models: Annotated[str | None, typer.Option(
        metavar="A,B,...", help="Run the same media through each of these models' "
                                "processors and put them side by side (tokens per item, ms per "
                                "stage) in one result, mm-processor-compare-*.json.")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
    output_format: Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)] = "table",
) -> None:
    """Preprocessing per stage (fetch, decode, hash, cache lookup, HF processor, encoder),
    cold (media never seen) and warm (processor cache hits), offline."""
    from aphrodite_cli.bench.data.datasets import parse_buckets
    from aphrodite_cli.bench.offline.mm_processor import STAGES, run_mm_processor
    from aphrodite_cli.bench.results.files import write_result

    if compare_models:
        models = [m.strip() for m in compare_models.split(",") if m.strip()]
        if len(models) < 2 or model:
            raise typer.BadParameter("give two or more models, and no --model",
                                     param_hint="--compare-models")
        docs = [run_mm_processor(m, num_prompts=num_prompts,
                                 buckets=parse_buckets(bucket_config), items=items_per_request,
                                 media_delivery=media_delivery, mode=mode, seed=seed,
                                 encoder=encoder, jsonl=dataset_path, media_dir=media_dir)
                for m in models]
        _print_comparison(docs, output_format)
        path = write_result({"models": models, "results": docs}, "mm-processor-compare",
                            out_dir)
        (err if output_format == "json" else out).print(f"result: {path}", markup=False)
        return
    doc = run_mm_processor(
        model, num_prompts=num_prompts, buckets=parse_buckets(bucket_config),
        items=items_per_request, media_delivery=media_delivery, mode=mode, seed=seed,
        encoder=encoder, video_backends=parse_backend_choices(
            video_backends, flag="--video-backends") if video_backends else None,
        jsonl=dataset_path, media_dir=media_dir)
    path = write_result(doc, "mm-processor", out_dir)
    say = err if output_format == "json" else out
    print_table(f"{doc['model']}: {num_prompts} prompts, median ms per stage",
                ["phase", "total", "p90", "p99", "hit rate", *(s[:-2] for s in STAGES)],
                [[phase, f"{p['total_s']['median'] * 1e3:.2f}",
                  f"{p['total_s']['p90'] * 1e3:.2f}", f"{p['total_s']['p99'] * 1e3:.2f}",
                  f"{p['hit_rate']:.0%}", *(f"{p['stages'][s]['median'] * 1e3:.2f}"
                                            for s in STAGES)]
                 for phase, p in doc["phases"].items()], output_format)
    source = doc["source"]
    parts = ", ".join(f"{name.replace('_', ' ')} {source[name]}" for name in (
        "image_processor", "video_processor", "feature_extractor") if source.get(name))
    say.print(f"processor: {source['processor']}" + (f" ({parts})" if parts else ""),
              markup=False)
    if "cold_over_warm_median" in doc:
        say.print(f"warm is {doc['cold_over_warm_median']:.1f}x faster than cold (median), "
                  f"{doc['cold_over_warm_median_after_fetch']:.1f}x after the fetch (hash, "
                  "lookup, decode, processor)", markup=False)
    for row in doc.get("video_backends", []):
        timing = (f"{row['decode_ms']['median']:.1f} ms median" if row["decode_ms"].get("count")
                  else row["error"])
        say.print(f"  video decode {row['backend']:<11} {row['clip']}, "
                  f"{row['frames_sampled']} frames: {timing}", markup=False)
    say.print(f"result: {path}", markup=False)


def _print_comparison(docs: list[dict], fmt: str) -> None:
    """Models side by side: processor classes, tokens per item, median ms per stage."""
    rows = []
    for doc in docs:
        source = doc["source"]
        tokens = doc["tokens_per_item"]
        for phase, p in doc["phases"].items():
            rows.append([doc["model"], source.get("image_processor") or source["processor"],
                         source.get("commit") or "", phase,
                         *(f"{tokens[m]['median']:.0f}" if m in tokens else "-"
                           for m in ("image", "video", "audio")),
                         f"{p['total_s']['median'] * 1e3:.2f}",
                         f"{p['stages']['processor_s']['median'] * 1e3:.2f}",
                         f"{p['stages']['encoder_s']['median'] * 1e3:.2f}"])
    print_table(f"{docs[0]['num_prompts']} prompts, the same media for each model",
                ["model", "processor", "commit", "phase", "tokens/image", "tokens/video",
                 "tokens/audio", "total ms", "processor ms", "encoder ms"], rows, fmt)


def batching(
    model: Annotated[str | None, typer.Option(help="Model; default: the tiny Qwen2.5-VL.")
                     ] = None,
    concurrency: Annotated[int, typer.Option(
        min=1, help="Requests at once (uniform); --max-num-seqs of the engine (mixed).")] = 8,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, help="Output tokens per request (uniform, default 32); of the long requests "
                    "(mixed, default 256).")] = None,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    workload: Annotated[BatchingWorkload, typer.Option(
        help="uniform: N equal image requests at once vs one after another. mixed: short and "
             "long outputs interleaved (one in four long), static vs continuous batching "
             "side by side, plus a short request sent behind a long generation.")
    ] = "uniform",
    num_prompts: Annotated[int | None, typer.Option(
        min=1, help="mixed: requests per run (default 4 x --concurrency).")] = None,
    short_tokens: Annotated[int | None, typer.Option(
        min=1, help="mixed: output tokens of the short requests (default --max-tokens / 16, "
                    "at least 4).")] = None,
    behind_long_tokens: Annotated[int, typer.Option(
        min=1, help="mixed: length of the generation the short request is sent behind.")
    ] = 512,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
) -> None:
    """Batching: N concurrent requests vs one after another, or (--workload mixed) static vs
    continuous batching on short and long outputs interleaved."""
    from aphrodite_cli.bench.results.files import write_result

    if workload == "mixed":
        from aphrodite_cli.bench.offline.batching import MODES, run_mixed

        max_tokens = max_tokens or 256
        doc = run_mixed(model, concurrency=concurrency, max_tokens=max_tokens, repeats=repeats,
                        num_prompts=num_prompts, short_tokens=short_tokens,
                        behind_long_tokens=behind_long_tokens)
        path = write_result(doc, "batching", out_dir)
        rows = []
        for mode in MODES:
            part = doc[mode]
            behind = part["short_behind_long"]
            rows.append([mode, f"{part['output_throughput']['median']:.1f}",
                         f"{part['request_throughput']['median']:.2f}",
                         f"{part['short_ttft_s']['median'] * 1000:.0f}",
                         f"{behind['behind_long_ttft_s']['median'] * 1000:.0f} "
                         f"({behind['ttft_ratio_median']:.1f}x solo)",
                         str(sum(behind["finished_before_long"])) + f"/{repeats}"])
        print_table(f"{doc['num_prompts']} requests, one in four of {max_tokens} tokens, the "
                    f"others {doc['short_tokens']}; --max-num-seqs {concurrency}",
                    ["scheduling", "output tok/s", "req/s", "short TTFT p50 ms",
                     f"TTFT behind a {behind_long_tokens}-token run, ms",
                     "finished before it"], rows)
        out.print(f"continuous / static output throughput: "
                  f"{doc['continuous_over_static_output_throughput']:.2f}x", markup=False)
        out.print(f"result: {path}", markup=False)
        return
    from aphrodite_cli.bench.offline.batching import run_batching

    max_tokens = max_tokens or 32
    doc = run_batching(model, concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    path = write_result(doc, "batching", out_dir)
    out.print(f"{concurrency} concurrent: {doc['concurrent_s']['median']:.2f} s, one after "
              f"another: {doc['sequential_s']['median']:.2f} s -> {doc['speedup_median']:.1f}x",
              markup=False)
    out.print(f"result: {path}", markup=False)


#: ``aphrodite bench decode-step --help``'s epilog.
DECODE_STEP_EXAMPLES = """Examples:

  aphrodite bench decode-step                       # the tiny Qwen2.5-VL, all CPUs

  aphrodite bench decode-step --size small --batch-sizes 1,8 --context-lens 512
  --num-threads 1

  aphrodite bench decode-step --model /models/qwen2.5-vl-3b --num-threads 2

ms per step is the median of --repeats steps of the engine's decode step (runner.decode: the
lean step where the model has one, sampling included); the bytes are the language model's
weights plus the rows' keys and values; the floor is those bytes over the read bandwidth
measured on the same threads beside that configuration's steps (a float32 sum over a tensor
4x the last-level cache, read before each timed step, an untimed step between: a shared
machine's bandwidth drifts over a run); x floor is the step over it.

  aphrodite bench decode-step --size small --quantization int8 --num-threads 1

--quantization int8 loads the model twice, as it is and with int8 weights (serve's
--quantization), times each configuration on both in turn (vs f32: the int8 step over the
float one) and compares them on a fixed set of 8 text prompts: greedy token agreement
(teacher-forced, and of int8's own greedy continuation) and the mean KL divergence of the
next-token distributions, float32 against int8.

  aphrodite bench decode-step --size small --batch-sizes 1,8 --compile-decode --num-threads 1

--compile-decode loads the model with serve's --compile-decode, waits for its background
compiles, and times each configuration on the eager and the compiled step in turn (vs eager:
the compiled step over the eager one)."""


def _variant(row: dict) -> str:
    """A decode-step row's weights and step: as loaded, the quantization, eager or compiled."""
    if row.get("compiled") is not None:
        return "compiled" if row["compiled"] else "eager"
    return row["quantization"] if row["quantization"] != "none" else "as loaded"


def _vs(row: dict) -> str:
    ratio = row.get("vs_unquantized") or row.get("vs_eager")
    return f"{ratio:.2f}" if ratio else "-"


def _counts(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of positive "
                                 "integers, e.g. 1,4,8", param_hint=flag)
    return values


def decode_step(
    model: Annotated[str | None, typer.Option(
        help="Model folder, hub id or tiny:ARCH; default: the embedded tiny Qwen2.5-VL.")
    ] = None,
    size: Annotated[ModelSizeName | None, typer.Option(
        help="A random-weight Qwen2.5-VL of this size instead of --model, built once into "
             "the cache as `aphrodite model make-tiny --size` builds it (small ~43 M "
             "parameters, medium ~150 M).")] = None,
    batch_sizes: Annotated[str, typer.Option(metavar="N,N,...", help="Rows per step.")
                           ] = "1,4,8",
    context_lens: Annotated[str, typer.Option(
        metavar="N,N,...", help="Tokens in each row's cache at the middle timed step.")
    ] = "128,512",
    num_threads: Annotated[int | None, typer.Option(
        min=1, help="Torch threads of the steps and of the bandwidth probe; default: the "
                    "CPUs this process may use (as serve).")] = None,
    warmups: Annotated[int, typer.Option(min=0, help="Untimed steps first.")] = 3,
    repeats: Annotated[int, typer.Option(min=1, help="Timed steps per configuration.")] = 20,
    read_mib: Annotated[int | None, typer.Option(
        min=1, help="MiB the bandwidth probe reads (default: 4x the last-level cache, at "
                    "least 256).")] = None,
    quantization: Annotated[str | None, typer.Option(
        metavar=choices_metavar(QUANTIZATIONS),
        help="Also time the model quantized by this method (serve's --quantization) beside "
             "the float one, and report its quality cost against it.")] = None,
    compile_decode: Annotated[bool, typer.Option(
        "--compile-decode", help="Load the model with serve's --compile-decode, wait for its "
                                 "compiles, and time each configuration on the eager and the "
                                 "compiled step in turn.")] = False,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
    output_format: Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)] = "table",
) -> None:
    """Time the engine's decode step per batch size and context length beside its floor: the
    bytes it must read (weights + KV) over this machine's read bandwidth."""
    from aphrodite_cli.bench.offline.decode_step import run_decode_step
    from aphrodite_cli.bench.results.files import write_result
    from engine.config import EngineConfig
    from engine.cpus import usable_cpus

    EngineConfig(quantization=quantization)  # (an unknown method: refused before loading)
    if compile_decode and quantization is not None:
        raise typer.BadParameter("--compile-decode compiles float32 layers: leave out "
                                 "--quantization", param_hint="--compile-decode")
    if size is not None and model is not None:
        raise typer.BadParameter("give --model or --size, not both", param_hint="--size")
    batches = _counts(batch_sizes, "--batch-sizes")
    contexts = _counts(context_lens, "--context-lens")
    before = (warmups + repeats // 2) * (2 if compile_decode else 1)
    if min(contexts) <= before:
        raise typer.BadParameter(
            f"each context length must exceed (--warmups + --repeats / 2)"
            f"{' x 2 (--compile-decode)' if compile_decode else ''} ({before}): the steps "
            "before the middle one grow the cache",
            param_hint="--context-lens")
    if size is not None:
        from engine.models.loader import tiny_model_dir

        model = str(tiny_model_dir(size=size))
    doc = run_decode_step(model, batch_sizes=batches, context_lens=contexts,
                          num_threads=num_threads or usable_cpus(), warmups=warmups,
                          repeats=repeats, read_bytes=read_mib << 20 if read_mib else None,
                          quantization=quantization, compile_decode=compile_decode)
    if size is not None:
        doc["size"] = size
    path = write_result(doc, "decode-step", out_dir)
    bw = doc["bandwidth"]
    print_table(f"{size or doc['model']}: decode step ({doc['decode_path']}, attention: "
                f"{doc['decode_attention']}, linear kernel products: "
                f"{doc['decode_linear_kernel_products']}"
                f"{', layers in one call' if doc.get('decode_layers_in_one_call') else ''}"
                f", vectors of "
                f"{doc['decode_kernel_vector_floats'] or '-'} floats), {doc['num_threads']} "
                f"threads, read bandwidth {bw['gb_s']['median']:.1f} GB/s",
                ["step", "batch", "context", "ms p50", "ms p90", "MB read", "GB/s",
                 "floor ms", "x floor", "vs f32/eager"],
                [[_variant(r),
                  r["batch_size"], r["context_len"], f"{r['step_ms']['median']:.2f}",
                  f"{r['step_ms']['p90']:.2f}", f"{r['bytes'] / 1e6:.1f}",
                  f"{r['achieved_gb_s']:.1f}", f"{r['floor_ms']:.2f}",
                  f"{r['ratio_to_floor']:.2f}",
                  _vs(r)] for r in doc["rows"]], output_format)
    if doc.get("compile") and output_format != "json":
        c = doc["compile"]
        out.print(f"compiled buckets {c['buckets']} (waited {c['wait_s']:.0f} s for them; "
                  f"graphs compiled during the steps: {c['graphs_compiled_in_steps']})"
                  + (f"; compile error: {c['error']}" if c["error"] else ""), markup=False)
    for method, q in (doc.get("quality") or {}).items() if output_format != "json" else ():
        print_table(f"{method} against the weights as loaded: {q['prompts']} prompts x "
                    f"{q['tokens_per_prompt']} greedy tokens",
                    ["top-1 agreement", "greedy match", "identical prompts", "mean KL (nats)"],
                    [[f"{q['top1_agreement']:.3f}", f"{q['greedy_match']:.3f}",
                      f"{q['identical_prompts']}/{q['prompts']}", f"{q['mean_kl']:.2e}"]],
                    output_format)
    (err if output_format == "json" else out).print(f"result: {path}", markup=False)
