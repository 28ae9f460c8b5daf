"""``aphrodite bench ...`` commands."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.options import (
    OUTPUT_FORMAT_HELP,
    DatasetName,
    DecodeIsolation,
    MediaDelivery,
    Mode,
    OutputFormat,
    SweepProfile,
)
from aphrodite_cli.output import err, out, print_table

app = typer.Typer(help="Benchmarks that write result files.", no_args_is_help=True)

DEFAULT_BACKENDS = \
    "opencv,pyav,pyav:isolation=process,pyav:skip_nonref=false,torchcodec,deepstream"


def parse_backend_list(text: str) -> list[tuple[str, dict]]:
    """``pyav:threads=2:skip_nonref=false,opencv`` -> [("pyav", {...}), ("opencv", {})]."""
    backends = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, *opts = item.split(":")
        options = {}
        for opt in opts:
            key, _, raw = opt.partition("=")
            try:
                options[key] = json.loads(raw)
            except json.JSONDecodeError:
                options[key] = raw
        backends.append((name, options))
    return backends


@app.command(
    "video-decode",
    epilog="""Examples:

  aphrodite bench video-decode                      # the standard 10 s 1080p30 H.264 clip

  aphrodite bench video-decode clip.mp4 --backends pyav,torchcodec:seek_mode=approximate

Backend options follow the name: NAME:KEY=VALUE:KEY=VALUE. isolation=process runs the decode
in a decode worker process, as `serve --decode-isolation process` does (frames handed back
through shared memory), so the row beside the plain one is the isolation's overhead.""",
)
def video_decode(
    clip: Annotated[Path | None, typer.Argument(help="Video file; default: the standard clip, "
                                                "generated once into the cache.")] = None,
    backends: Annotated[str, typer.Option(help="Comma-separated backends with options.")
                        ] = DEFAULT_BACKENDS,
    num_frames: Annotated[int, typer.Option(min=1, help="Frames sampled per decode.")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats of everything.")] = 5,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the result JSON goes.")
                       ] = Path("results"),
) -> None:
    """Time sampled decoding per backend against a full ffmpeg decode of the same clip."""
    from aphrodite_cli.bench import video_decode as runner
    from aphrodite_cli.bench.results import write_result

    path = clip or runner.standard_clip()
    doc = runner.run(path, parse_backend_list(backends), num_frames=num_frames,
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


@app.command(
    "mm-processor",
    epilog="""Examples:

  aphrodite bench mm-processor                       # 1280x720 JPEGs on the tiny Qwen2.5-VL

  aphrodite bench mm-processor --bucket-config '{"720,1280,1": 0.6, "360,640,16": 0.4}'
  --items-per-request 2 --video-backends opencv,pyav,torchcodec

  aphrodite bench mm-processor --model /models/qwen2.5-vl-7b --num-prompts 50""",
)
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
             "opencv,pyav,torchcodec.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
    output_format: Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)] = "table",
) -> None:
    """Preprocessing per stage (fetch, decode, hash, cache lookup, HF processor, encoder),
    cold (media never seen) and warm (processor cache hits), offline."""
    from aphrodite_cli.bench.datasets import parse_buckets
    from aphrodite_cli.bench.engine_bench import STAGES, run_mm_processor
    from aphrodite_cli.bench.results import write_result

    doc = run_mm_processor(
        model, num_prompts=num_prompts, buckets=parse_buckets(bucket_config),
        items=items_per_request, media_delivery=media_delivery, mode=mode, seed=seed,
        encoder=encoder, video_backends=[b.strip() for b in video_backends.split(",")
                                         if b.strip()] if video_backends else None,
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


@app.command("batching")
def batching(
    model: Annotated[str | None, typer.Option(help="Model; default: the tiny Qwen2.5-VL.")
                     ] = None,
    concurrency: Annotated[int, typer.Option(min=1)] = 8,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
) -> None:
    """N concurrent image requests (sharing forward passes) vs the same N one after another."""
    from aphrodite_cli.bench.engine_bench import run_batching
    from aphrodite_cli.bench.results import write_result

    doc = run_batching(model, concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    path = write_result(doc, "batching", out_dir)
    out.print(f"{concurrency} concurrent: {doc['concurrent_s']['median']:.2f} s, one after "
              f"another: {doc['sequential_s']['median']:.2f} s -> {doc['speedup_median']:.1f}x",
              markup=False)
    out.print(f"result: {path}", markup=False)


@app.command(
    "serve",
    epilog="""Examples:

  aphrodite bench serve --embedded --num-prompts 50 --mode both

  aphrodite bench serve --base-url http://gpu-box:8000 --model Qwen/Qwen2.5-VL-7B-Instruct
  --request-rate 4 --burstiness 0.5 --max-concurrency 16 --media-delivery http
  --bucket-config '{"720,1280,1": 0.7, "360,640,32": 0.3}' --goodput ttft:500,tpot:50

  aphrodite bench serve --base-url http://localhost:2242/v1 --dataset jsonl
  --dataset-path requests.jsonl --media-dir ./media --csv

vLLM's flags work as given (--dataset-name, --result-dir, --result-filename, --save-result,
--percentile-metrics, --metric-percentiles, --goodput ttft:500 tpot:50, --tokenizer,
--ignore-eos, --temperature, --host/--port, --endpoint); see the README's table.""",
    context_settings={"allow_extra_args": True},
)
def serve_cmd(
    ctx: typer.Context,
    base_url: Annotated[str | None, typer.Option(
        help="The target: its root as vLLM takes it (http://localhost:8000) or an OpenAI "
             "base URL ending in /v1; requests go to --endpoint under the root.")] = None,
    host: Annotated[str | None, typer.Option(help="Target host, with --port, instead of "
                                             "--base-url (vLLM's flags).")] = None,
    port: Annotated[int | None, typer.Option(help="Target port (with --host, default "
                                             "127.0.0.1).")] = None,
    endpoint: Annotated[str | None, typer.Option(
        help="Path posted to under the root (default /v1/chat/completions; /v1/completions "
             "sends text prompts).")] = None,
    backend: Annotated[str | None, typer.Option(
        help="vLLM's --backend: openai-chat (/v1/chat/completions) or openai/vllm "
             "(/v1/completions), when --endpoint is not given.")] = None,
    embedded: Annotated[bool, typer.Option(help="Start this project's server (tiny default "
                                           "model) for the run.")] = False,
    model: Annotated[str | None, typer.Option(
        help="Model name to send (and to serve with --embedded); default: the first of the "
             "target's GET /v1/models.")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key for the target.")] = None,
    dataset: Annotated[DatasetName, typer.Option(
        "--dataset", "--dataset-name",
        help="random-mm, jsonl, or vLLM's random (text only: random-mm with no media).")
    ] = "random-mm",
    dataset_path: Annotated[Path | None, typer.Option(help="JSONL file for --dataset jsonl.")
                            ] = None,
    media_dir: Annotated[Path | None, typer.Option(help="Folder for media paths in JSONL.")
                         ] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 50,
    num_warmups: Annotated[int, typer.Option(min=0, help="Unmeasured requests first.")] = 2,
    request_rate: Annotated[str, typer.Option(help="Requests/s, or inf.")] = "inf",
    burstiness: Annotated[float, typer.Option(min=0.01, help="Gamma shape; 1 = Poisson.")
                          ] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    seed: Annotated[int, typer.Option()] = 0,
    mode: Annotated[Mode, typer.Option(help="cold, warm or both.")] = "both",
    media_delivery: Annotated[MediaDelivery, typer.Option(
        help="data-url or http (a built-in loopback media server).")] = "data-url",
    items_per_request: Annotated[int, typer.Option(min=0)] = 1,
    bucket_config: Annotated[str | None, typer.Option(
        metavar="JSON", help='"height,width,frames": probability; frames > 1 is a video.')
    ] = None,
    prompt_len: Annotated[int, typer.Option(
        "--prompt-len", "--random-input-len", min=1,
        help="Words of text per prompt (vLLM's --random-input-len counts tokens; a word is "
             "about one token).")] = 32,
    output_len: Annotated[int, typer.Option(
        "--output-len", "--random-output-len", min=1, help="Tokens per answer.")] = 16,
    image_format: Annotated[str, typer.Option(help="JPEG, PNG or WEBP.")] = "JPEG",
    image_quality: Annotated[int, typer.Option(min=1, max=100)] = 90,
    video_codec: Annotated[str, typer.Option()] = "libx264",
    video_fps: Annotated[int, typer.Option(min=1)] = 30,
    video_gop: Annotated[int, typer.Option(min=1)] = 30,
    goodput: Annotated[str | None, typer.Option(
        help="SLOs in ms: ttft:200,tpot:50 or vLLM's ttft:200 tpot:50 (e2el = e2e).")] = None,
    percentile_metrics: Annotated[str, typer.Option(
        help="Metrics whose percentiles are printed and stored as vLLM's p{N}_{metric}_ms "
             "fields: ttft, tpot, itl, e2el.")] = "ttft,tpot,itl,e2el",
    metric_percentiles: Annotated[str, typer.Option(
        help="Those percentiles, e.g. 50,90,99.")] = "50,99",
    tokenizer: Annotated[str | None, typer.Option(
        help="Count output tokens with this tokenizer (folder or hub id) when the target "
             "reports no usage, instead of counting stream chunks.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        help="Ask for every answer's full --output-len (ignore_eos).")] = True,
    temperature: Annotated[float, typer.Option(min=0)] = 0.0,
    save_result: Annotated[bool, typer.Option(
        help="Accepted for vLLM's scripts: the result is always saved.")] = True,
    result_filename: Annotated[str | None, typer.Option(
        help="File name of the result in --out-dir (default serve-<time>.json).")] = None,
    csv: Annotated[bool, typer.Option("--csv", help="Also write per-request rows as CSV.")
                   ] = False,
    jsonl: Annotated[bool, typer.Option(
        "--jsonl", help="Also write per-request rows as JSON lines (pandas.read_json(path, "
                        "lines=True) gives one row per request).")] = False,
    output_format: Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)] = "table",
    max_failure_rate: Annotated[float, typer.Option(
        min=0, max=1, help="Exit 1 when more than this share of a phase's requests failed.")
    ] = 0.0,
    abort_after_failures: Annotated[int, typer.Option(
        min=0, help="Stop at once (exit 1) when the first this-many answers are all the same "
                    "4xx, as a wrong URL, model or key gives; 0: never.")] = 5,
    out_dir: Annotated[Path, typer.Option("--out-dir", "--result-dir")] = Path("results"),
) -> None:
    """End-to-end latency and throughput of a chat endpoint, cold media and warm cache."""
    import math

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from aphrodite_cli.bench import vllm_compat
    from aphrodite_cli.bench.datasets import parse_buckets
    from aphrodite_cli.bench.results import write_result
    from aphrodite_cli.bench.serve_bench import LoadConfig
    from aphrodite_cli.bench.serve_run import run
    from engine.errors import ConfigError

    say = err if output_format == "json" else out  # stdout carries only the JSON then
    if base_url is None and (host or port):
        base_url = f"http://{host or '127.0.0.1'}:{port or 8000}"
    if embedded == bool(base_url):
        raise ConfigError("pass exactly one of --base-url URL (or --host/--port) or --embedded",
                          code="invalid_flag")
    if dataset == "random":  # vLLM's text-only random dataset
        dataset, items_per_request = "random-mm", 0
    if endpoint is None:
        backends = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions",
                    "vllm": "/v1/completions", None: "/v1/chat/completions"}
        if backend not in backends:
            raise ConfigError(f"--backend {backend!r} is not one of openai-chat, openai, vllm",
                              code="invalid_flag")
        endpoint = backends[backend]
    if not endpoint.rstrip("/").endswith("chat/completions") and (
            items_per_request > 0 or dataset == "jsonl"):
        raise ConfigError(f"--endpoint {endpoint} takes text prompts only, so it cannot carry "
                          "media", hint="use /v1/chat/completions, or --items-per-request 0 "
                          "(--dataset-name random)", code="invalid_flag")
    extra = list(ctx.args)
    goodput_parts = [goodput] if goodput else []
    if extra and goodput and all(re.fullmatch(r"[A-Za-z0-9]+:[0-9.]+", a) for a in extra):
        goodput_parts += extra  # vLLM's --goodput ttft:500 tpot:50
    elif extra:
        raise ConfigError(f"unexpected argument(s): {' '.join(extra)}",
                          hint="every value needs its flag (see --help)", code="invalid_flag")
    try:
        rate = math.inf if request_rate.lower() == "inf" else float(request_rate)
    except ValueError:
        raise ConfigError(f"--request-rate {request_rate!r} is a number or inf",
                          code="invalid_flag") from None
    slos = vllm_compat.parse_goodput(goodput_parts)
    pct_metrics = vllm_compat.parse_list("--percentile-metrics", percentile_metrics,
                                         set(vllm_compat.METRICS))
    pcts = vllm_compat.parse_percentiles(metric_percentiles)
    cfg = LoadConfig(base_url=base_url or "", endpoint="/" + endpoint.lstrip("/"),
                     abort_after=abort_after_failures, model=model if not embedded else None,
                     api_key=api_key, request_rate=rate, burstiness=burstiness,
                     max_concurrency=max_concurrency, seed=seed, media_delivery=media_delivery,
                     image_format=image_format.upper(), image_quality=image_quality,
                     video_codec=video_codec, video_fps=video_fps, video_gop=video_gop,
                     goodput=slos, temperature=temperature, ignore_eos=ignore_eos)
    opts = {"dataset": dataset, "dataset_path": dataset_path, "media_dir": media_dir,
            "num_prompts": num_prompts, "num_warmups": num_warmups, "mode": mode,
            "items_per_request": items_per_request, "buckets": parse_buckets(bucket_config),
            "prompt_len": prompt_len, "output_len": output_len, "seed": seed,
            "embedded": embedded, "model": model, "percentile_metrics": pct_metrics,
            "metric_percentiles": pcts,
            "tokenizer": vllm_compat.load_tokenizer(tokenizer) if tokenizer else None}
    from aphrodite_cli.bench.serve_bench import TargetRefused
    from engine.errors import BenchmarkFailed

    try:
        # progress on stderr, and only on a terminal: logs and pipes get the results alone
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                      disable=not err.is_terminal) as progress:
            doc = run(cfg, opts, progress,
                      announce=lambda msg: say.print(msg, markup=False))
    except TargetRefused as refused:
        first = refused.records[0]
        raise BenchmarkFailed(
            f"the first {len(refused.records)} requests to {refused.url} all got HTTP "
            f"{first.status} ({first.error}); the run was stopped. The target said: "
            f"{(first.error_body or '').strip()[:300]}",
            hint="check --base-url/--endpoint, --model and --api-key "
                 "(--abort-after-failures 0 runs on regardless)") from None
    rows = doc.pop("_rows")
    doc["percentile_metrics"], doc["metric_percentiles"] = pct_metrics, pcts
    doc["tokenizer"] = tokenizer
    doc["requests"] = rows  # per phase, one record per request (as in the CSV / JSONL)
    path = write_result(doc, "serve", out_dir, filename=result_filename)
    flat = [r for phase in rows.values() for r in phase]
    if csv:
        import pandas as pd

        frame = pd.DataFrame(flat)
        frame["itl_ms"] = frame["itl_ms"].map(lambda gaps: " ".join(f"{g:g}" for g in gaps))
        frame.to_csv(path.with_suffix(".csv"), index=False)
    if jsonl:
        path.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in flat))
    _print_serve_table(doc, output_format)
    say.print(f"result: {path}", markup=False)
    too_many = []
    for mode, phase in doc["phases"].items():
        total = phase["completed"] + phase["failed"]
        for kind, count in phase["failures_by_type"].items():
            example = (phase["failure_examples"].get(kind) or "").strip()[:300]
            say.print(f"  {mode}: {count} x {kind}" + (f": {example}" if example else ""),
                      markup=False)
        if total and phase["failed"] / total > max_failure_rate:
            too_many.append(f"{mode} phase: {phase['failed']} of {total} requests failed")
    failed = [f"{m}: {p['cache_check']}" for m, p in doc["phases"].items()
              if p.get("cache_check") not in (None, "ok")]
    if failed:
        raise ConfigError("; ".join(failed), hint="the cache state the phase needs was not "
                          "reached (was the target restarted, or its cache disabled?)",
                          code="cache_state_mismatch")
    if too_many:
        raise BenchmarkFailed("; ".join(too_many) + f" (more than --max-failure-rate "
                              f"{max_failure_rate:g}); result: {path}",
                              hint="the failures by type are listed above; --max-failure-rate "
                                   "sets how many a run may have", code="requests_failed")


def _print_serve_table(doc: dict, fmt: str = "table") -> None:
    metrics = doc.get("percentile_metrics") or ["ttft", "tpot", "itl", "e2el"]
    pcts = doc.get("metric_percentiles") or [50.0, 99.0]
    columns = ["phase", "ok/failed", "req/s", "out tok/s",
               *(f"{m.upper()} {'/'.join(f'p{p:g}' for p in pcts)} ms" for m in metrics),
               "cache hit"]
    rows = []
    for mode, p in doc["phases"].items():
        hit = p["server_cache"]["hit_rate"]
        cells = ["/".join("-" if p.get(f"p{q:g}_{m}_ms") is None else
                          f"{p[f'p{q:g}_{m}_ms']:.1f}" for q in pcts) for m in metrics]
        rows.append([mode, f"{p['completed']}/{p['failed']}", f"{p['request_throughput']:.2f}",
                     f"{p['output_throughput']:.1f}", *cells,
                     "-" if hit is None else f"{hit:.0%}"])
    print_table(f"bench serve: {doc['num_prompts']} prompts per phase", columns, rows, fmt)


@app.command(
    "mock-server",
    epilog="""Example:

  aphrodite bench mock-server --port 9000 --ttft-ms 50 --itl-ms 10""",
)
def mock_server(
    port: Annotated[int, typer.Option(min=1, max=65535)] = 9000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    ttft_ms: Annotated[float, typer.Option(min=0)] = 0.0,
    itl_ms: Annotated[float, typer.Option(min=0)] = 0.0,
    output_tokens: Annotated[int | None, typer.Option(
        min=1, help="Tokens per answer (default: the request's max_tokens).")] = None,
    headers_ms: Annotated[float, typer.Option(
        min=0, help="When a stream's response headers are sent (at most --ttft-ms); a "
        "client that times TTFT from the headers is caught when this is above 0.")] = 0.0,
    model: Annotated[str, typer.Option(help="The model it serves (GET /v1/models).")
                     ] = "mock",
    require_model: Annotated[bool, typer.Option(
        help="Answer 400, as the OpenAI API does, to a request without --model's name.")
    ] = False,
    max_concurrency: Annotated[int | None, typer.Option(
        min=1, help="Serve at most this many requests at once (the others wait): a known "
                    "capacity of N / (ttft + itl x (tokens - 1)) requests/s.")] = None,
    usage: Annotated[bool, typer.Option(
        help="Send a usage chunk at the end of a stream (--no-usage: like servers that "
             "report none).")] = True,
) -> None:
    """A mock OpenAI-compatible endpoint streaming tokens with a set TTFT and ITL."""
    from aiohttp import web

    from aphrodite_cli.bench.mock_server import create_app

    out.print(f"mock server on http://{host}:{port}/v1 (ttft {ttft_ms} ms, itl {itl_ms} ms)",
              markup=False)
    web.run_app(create_app(ttft_ms, itl_ms, output_tokens, headers_ms, model=model,
                           require_model=require_model, max_concurrency=max_concurrency,
                           usage=usage),
                host=host, port=port, print=None, access_log=None)


@app.command(
    "sweep",
    epilog="""Examples:

  aphrodite bench sweep --embedded --mode both --slo ttft:p99:300 --slo e2el:p90:2000

  aphrodite bench sweep --base-url http://gpu-box:8000 --rates 1,2,4,8 --items-per-request 1

  aphrodite bench sweep --base-url http://gpu-box:8000 --profile sweep --num-points 6

Each point is a bench serve measurement; the result holds every point, the curve and, with
--slo, the capacity per phase (the highest rate meeting every SLO).""",
)
def sweep_cmd(
    base_url: Annotated[str | None, typer.Option(
        help="The target's root (http://host:8000) or a base URL ending in /v1.")] = None,
    host: Annotated[str | None, typer.Option(help="Target host, with --port.")] = None,
    port: Annotated[int | None, typer.Option(help="Target port.")] = None,
    endpoint: Annotated[str, typer.Option(help="Path posted to under the root.")
                        ] = "/v1/chat/completions",
    embedded: Annotated[bool, typer.Option(help="Start this project's server for the run.")
                        ] = False,
    model: Annotated[str | None, typer.Option(
        help="Model name to send; default: the first of GET /v1/models.")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key for the target.")] = None,
    mode: Annotated[Mode, typer.Option(help="cold, warm or both.")] = "cold",
    rates: Annotated[str | None, typer.Option(help="Request rates to measure, e.g. 1,2,4,8.")
                     ] = None,
    concurrencies: Annotated[str | None, typer.Option(
        help="Concurrencies to measure (closed loop), e.g. 1,4,16.")] = None,
    profile: Annotated[SweepProfile | None, typer.Option(
        help="sweep: one at a time, all at once, then --num-points rates between.")] = None,
    num_points: Annotated[int, typer.Option(min=1)] = 5,
    slo: Annotated[list[str] | None, typer.Option(
        help="metric:percentile:ms, repeatable, e.g. ttft:p99:300 (metrics ttft, tpot, itl, "
             "e2e or e2el): search the highest rate meeting them all.")] = None,
    rate_precision: Annotated[float, typer.Option(
        min=0.001, max=1, help="Stop the search when its bracket is this narrow.")] = 0.05,
    duration_s: Annotated[float, typer.Option(min=0.1, help="Seconds of one rate point.")
                          ] = 10.0,
    min_requests: Annotated[int, typer.Option(min=2, help="Requests per point at least.")
                            ] = 20,
    num_warmups: Annotated[int, typer.Option(min=0, help="Unmeasured requests per point.")
                           ] = 2,
    burstiness: Annotated[float, typer.Option(min=0.01, help="Gamma shape; 1 = Poisson.")
                          ] = 1.0,
    num_prompts: Annotated[int, typer.Option(
        min=1, help="Requests in the warm phase's pool (sent once before its points).")] = 50,
    items_per_request: Annotated[int, typer.Option(min=0)] = 1,
    bucket_config: Annotated[str | None, typer.Option(
        metavar="JSON", help='"height,width,frames": probability; frames > 1 is a video.')
    ] = None,
    prompt_len: Annotated[int, typer.Option(min=1)] = 32,
    output_len: Annotated[int, typer.Option(min=1)] = 16,
    media_delivery: Annotated[MediaDelivery, typer.Option(help="data-url or http.")
                              ] = "data-url",
    max_failure_rate: Annotated[float, typer.Option(
        min=0, max=1, help="Exit 1 when more than this share of a point's requests failed.")
    ] = 0.0,
    seed: Annotated[int, typer.Option()] = 0,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
) -> None:
    """Latency against load, and the capacity at an SLO, cold media and warm cache."""
    from aphrodite_cli.bench import sweep as sw
    from aphrodite_cli.bench.datasets import parse_buckets, random_mm
    from aphrodite_cli.bench.results import write_result
    from aphrodite_cli.bench.serve_bench import (
        LoadConfig,
        TargetRefused,
        first_model,
        server_root,
    )
    from aphrodite_cli.bench.serve_run import EmbeddedServer
    from engine.errors import BenchmarkFailed, ConfigError

    if base_url is None and (host or port):
        base_url = f"http://{host or '127.0.0.1'}:{port or 8000}"
    if embedded == bool(base_url):
        raise ConfigError("pass exactly one of --base-url URL (or --host/--port) or --embedded",
                          code="invalid_flag")
    try:
        rate_list = [float(r) for r in (rates or "").split(",") if r.strip()]
        conc_list = [int(c) for c in (concurrencies or "").split(",") if c.strip()]
    except ValueError:
        raise ConfigError("--rates and --concurrencies are comma-separated numbers",
                          code="invalid_flag") from None
    slos = [sw.Slo.parse(s) for s in slo or []]
    if sum(map(bool, (rate_list or conc_list, profile, slos))) > 1:
        raise ConfigError("pick one of --rates/--concurrencies, --profile sweep or --slo",
                          code="invalid_flag")
    buckets = parse_buckets(bucket_config)
    settings = sw.SweepSettings(duration_s=duration_s, min_requests=min_requests,
                                num_warmups=num_warmups, num_points=num_points,
                                rate_precision=rate_precision)

    def make(n: int, run_nonce: int) -> list:
        return random_mm(n, items=items_per_request, buckets=buckets, prompt_len=prompt_len,
                         output_len=output_len, seed=seed, nonce=run_nonce)

    def on_point(phase: str, point: dict) -> None:
        what = (f"rate {point['offered_rate']:.3g}/s" if point["offered_rate"] else
                f"concurrency {point['concurrency']}" if point["concurrency"] else
                "all at once")
        served = point["served_rate"]
        e2e = point["result"]["e2e_ms"].get("p90")
        verdict = "" if not slos else (" meets the SLOs" if point["met"] else " misses")
        out.print(f"  {phase} {point['kind']:<12} {what:<18} served "
                  f"{served or 0:.3g}/s, e2e p90 {e2e or 0:.1f} ms{verdict}", markup=False)

    server = EmbeddedServer(model, []) if embedded else None
    try:
        root = server_root(server.base_url if server else base_url or "")
        name = model or first_model(root, api_key)
        cfg = LoadConfig(base_url=root, endpoint="/" + endpoint.lstrip("/"), model=name,
                         api_key=api_key, burstiness=burstiness, seed=seed,
                         media_delivery=media_delivery)
        modes = ("cold", "warm") if mode == "both" else (mode,)
        try:
            doc = sw.run(cfg, make, modes=modes, settings=settings, slos=slos,
                         rates=rate_list, concurrencies=conc_list, pool_size=num_prompts,
                         seed=seed, media_delivery=media_delivery, on_point=on_point)
        except TargetRefused as refused:
            first = refused.records[0]
            raise BenchmarkFailed(
                f"the first {len(refused.records)} requests to {refused.url} all got HTTP "
                f"{first.status} ({first.error}); the sweep was stopped. The target said: "
                f"{(first.error_body or '').strip()[:300]}",
                hint="check --base-url/--endpoint, --model and --api-key") from None
    finally:
        if server:
            server.stop()
    doc = {"kind": "sweep",
           "target": {"base_url": root, "endpoint": cfg.endpoint, "model": name,
                      "embedded": embedded},
           "slos": [s.label for s in slos], "keep_up_share": sw.KEEP_UP,
           "settings": settings.__dict__, "burstiness": burstiness,
           "dataset": {"items_per_request": items_per_request, "prompt_len": prompt_len,
                       "output_len": output_len, "buckets": {",".join(map(str, k)): v
                                                             for k, v in buckets.items()}},
           "noise": "an SLO is met only when the upper end of its percentile's 95% bootstrap "
                    "interval is within the limit: the capacity is conservative", **doc}
    path = write_result(doc, "sweep", out_dir)
    for phase, result in doc["phases"].items():
        cap = result["capacity"]
        if cap is not None:
            rate = f"{cap['rate']:.3g} requests/s" if cap["rate"] else "none"
            out.print(f"{phase} capacity: {rate} (limited by {cap['limited_by']}: "
                      f"{cap['why']}); {len(result['points'])} points in "
                      f"{result['seconds']:.0f} s", markup=False)
    out.print(f"result: {path}", markup=False)
    too_many = [f"{phase} {p['kind']} point"
                + (f" at {p['offered_rate']:.3g}/s" if p["offered_rate"] else "")
                + f": {p['result']['failed']} of {p['requests']} failed "
                f"({', '.join(p['result']['failures_by_type'])})"
                for phase, result in doc["phases"].items() for p in result["points"]
                # all at once may be refused by a server that sheds load, and so may the
                # search's points above the capacity: those failures are its answer
                if p["kind"] != "saturation" and (not slos or p["kind"] == "synchronous")
                and p["result"]["failed"] > max_failure_rate * p["requests"]]
    if too_many:
        raise BenchmarkFailed("; ".join(too_many[:5]) + f" (more than --max-failure-rate "
                              f"{max_failure_rate:g}); result: {path}",
                              hint="a point with failures measures errors, not the server",
                              code="requests_failed")


@app.command(
    "gate",
    epilog="""Examples:

  aphrodite bench gate --baseline results/baselines/serve-tiny.json --candidate results/serve-*.json

  aphrodite bench gate --baseline base1.json --baseline base2.json --candidate new1.json
  --candidate new2.json --threshold ttft_ms:10%,e2e_ms:5%

Sweeps (bench sweep with --slo) are compared on capacity: a drop of more than the threshold
(--threshold capacity:10%) is a regression.

Exit status: 1 when a metric regressed beyond its threshold with 95% confidence, else 0.""",
)
def gate(
    baseline: Annotated[list[Path], typer.Option(help="Baseline result file(s); repeat.")],
    candidate: Annotated[list[Path], typer.Option(help="Candidate result file(s); repeat.")],
    threshold: Annotated[str | None, typer.Option(
        help="Per-metric thresholds, e.g. ttft_ms:10%,e2e_ms:5% (default 5%).")] = None,
    markdown_out: Annotated[Path | None, typer.Option(
        "--markdown", help="Also write the verdict table to this file.")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        help="markdown (the verdict table; also for table) or json (for scripts).")
    ] = "markdown",
) -> None:
    """Decide whether a candidate run regressed against a baseline, with noise in mind."""
    from aphrodite_cli.bench import gate as g

    if all(g.is_sweep(p) for p in [*baseline, *candidate]):
        limits = g.parse_thresholds(threshold)
        capacity = g.compare_capacity(baseline, candidate,
                                      limits.get("capacity", g.DEFAULT_THRESHOLD))
        table = g.capacity_markdown(capacity)
        out.print(table, markup=False)
        if markdown_out:
            markdown_out.write_text(table + "\n")
        regressed = [v for v in capacity if v["regressed"]]
        out.print(f"\n{'REGRESSION' if regressed else 'PASS'}: capacity dropped in "
                  f"{len(regressed)} of {len(capacity)} phases", markup=False)
        raise typer.Exit(1 if regressed else 0)
    verdicts = g.compare(baseline, candidate, g.parse_thresholds(threshold))
    table = g.markdown(verdicts)
    regressed = [v for v in verdicts if v.regressed]
    if output_format == "json":
        from aphrodite_cli.output import print_json

        print_json({"verdicts": g.verdicts_json(verdicts), "regressed": len(regressed)})
        if markdown_out:
            markdown_out.write_text(table + "\n")
        raise typer.Exit(1 if regressed else 0)
    out.print(table, markup=False)
    if markdown_out:
        markdown_out.write_text(table + "\n")
    out.print(f"\n{'REGRESSION' if regressed else 'PASS'}: {len(regressed)} of {len(verdicts)} "
              "metrics regressed", markup=False)
    raise typer.Exit(1 if regressed else 0)


@app.command(
    "report",
    epilog="""Examples:

  aphrodite bench report results/serve-*.json results/mm-processor-*.json \\
      results/video-decode-*.json --out-dir results/report

  aphrodite bench report --baseline results/serve-A.json --candidate results/serve-B.json""",
)
def report(
    results: Annotated[list[Path] | None, typer.Argument(help="Result JSON files.")] = None,
    baseline: Annotated[list[Path] | None, typer.Option(
        help="A side of an A vs B comparison (serve results; repeat for several runs).")
    ] = None,
    candidate: Annotated[list[Path] | None, typer.Option(
        help="B side: the report opens with the gate's verdict and both sides' CDFs.")
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out-dir")] = None,
) -> None:
    """Plots, a self-contained HTML report and a Markdown summary for pull requests."""
    from aphrodite_cli.bench.report import write_report
    from engine.errors import ConfigError

    if bool(baseline) != bool(candidate):
        raise ConfigError("an A vs B report needs both --baseline and --candidate",
                          code="invalid_flag")
    files = list(results or []) + [p for p in [*(baseline or []), *(candidate or [])]
                                   if p not in (results or [])]
    if not files:
        raise ConfigError("pass result files, or --baseline and --candidate",
                          code="invalid_flag")
    html_path, md_path = write_report(files, out_dir, baseline=baseline, candidate=candidate)
    out.print(f"markdown summary: {md_path}", markup=False)
    out.print(f"report: {html_path}", markup=False)


@app.command(
    "soak",
    epilog="""Examples (the README's 10-minute runs: a quiet baseline, then under attack):

  aphrodite bench soak --duration 120 --hostile-share 0 --slow-bodies 0 --drip-flood 0
  aphrodite bench soak --duration 600 --hostile-share 0.25 --concurrency 4 \\
      --baseline results/soak-QUIET.json

Exit status 1 when a valid request got a 5xx, a hostile request or an attack got another
status than its rule's, memory grew more than --max-rss-growth after warm-up, temp files were
left, or valid requests' p99 latency was over --max-p99-ratio times the baseline's.""",
)
def soak(
    embedded: Annotated[bool, typer.Option(help="Start this project's server for the run.")
                        ] = True,
    duration: Annotated[float, typer.Option(min=1, help="Seconds to run.")] = 60.0,
    hostile_share: Annotated[float, typer.Option(min=0, max=1)] = 0.25,
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    warmup: Annotated[float, typer.Option(min=0, help="Seconds before memory is judged.")
                      ] = 10.0,
    max_rss_growth: Annotated[float, typer.Option(help="Allowed RSS growth after warm-up.")
                              ] = 0.25,
    decode_isolation: Annotated[DecodeIsolation, typer.Option(help="thread or process.")
                                ] = "process",
    bucket_config: Annotated[str | None, typer.Option(
        help='Valid media as in bench serve: "height,width,frames": probability; default '
             '{"64,96,1": 0.5, "240,320,1": 0.25, "240,320,30": 0.25}.')] = None,
    valid_pool: Annotated[int, typer.Option(
        min=1, help="Distinct valid requests, rendered before the run and drawn at random "
                    "(a share hit the processor cache).")] = 128,
    slow_bodies: Annotated[int, typer.Option(
        min=0, help="Connections that send a request's headers and then drip its body, "
                    "reopened as the server closes them (each must get 408).")] = 8,
    drip_flood: Annotated[int, typer.Option(
        min=0, help="Clients sending back to back requests whose media host drips (each "
                    "must get 400 media_fetch_timeout or 503 fetch_slots_busy).")] = 4,
    attacker_address: Annotated[str, typer.Option(
        help="Local address the attacks connect from (another client to the server; any "
             "127.x.y.z is this machine on Linux); empty: the default.")] = "127.0.0.2",
    request_body_timeout_s: Annotated[float, typer.Option(
        min=0.5, help="The server's --request-body-timeout-s for the run (how long a slow "
                      "body holds its connection).")] = 5.0,
    baseline: Annotated[Path | None, typer.Option(
        help="A quiet run's soak result: valid requests' p99 latency is compared with its.")
    ] = None,
    max_p99_ratio: Annotated[float, typer.Option(
        min=1, help="With --baseline: most valid p99 latency may grow, e.g. 3.")] = 3.0,
    seed: Annotated[int, typer.Option()] = 0,
    out_dir: Annotated[Path, typer.Option("--out-dir")] = Path("results"),
) -> None:
    """Valid, hostile and attacking traffic against the server for a set time; checks that
    valid requests are served, every attack is refused by its rule and nothing leaks."""
    from aphrodite_cli.bench.attackers import Attackers
    from aphrodite_cli.bench.datasets import parse_buckets
    from aphrodite_cli.bench.hostile import SERVER_ARGS, SERVER_ENV, HostileHost
    from aphrodite_cli.bench.results import write_result
    from aphrodite_cli.bench.serve_run import EmbeddedServer
    from aphrodite_cli.bench.soak import run_soak, server_roles
    from engine.errors import ConfigError

    if not embedded:
        raise ConfigError("bench soak runs against its embedded server (it watches the "
                          "server's processes)", hint="leave --embedded on")
    quiet_p99 = None
    if baseline is not None:
        from aphrodite_cli.bench.results import load_result

        quiet_p99 = (load_result(baseline, ("soak",)).get("valid_latency_s") or {}).get("p99")
        if not quiet_p99:
            raise ConfigError(f"--baseline {baseline} has no valid requests' latency",
                              hint="pass a soak result whose run had valid traffic",
                              code="result_wrong_kind")
    host = HostileHost()
    server = EmbeddedServer(None, ["--decode-isolation", decode_isolation, *SERVER_ARGS,
                                   # a small cache: it fills during warm-up, so growth after
                                   # warm-up is a leak, not the cache doing its job
                                   "--mm-processor-cache-gb", "0.02",
                                   "--request-body-timeout-s", f"{request_body_timeout_s:g}"],
                            env=SERVER_ENV)
    try:
        doc = run_soak(server.base_url, "tiny-qwen2_5_vl", server_roles("".join(server.lines)),
                       duration_s=duration, hostile_share=hostile_share,
                       concurrency=concurrency, seed=seed, media_base=host.base,
                       warmup_s=min(warmup, duration / 2),
                       buckets=parse_buckets(bucket_config) if bucket_config else None,
                       valid_pool=valid_pool, attackers=Attackers(
                           server.base_url, "tiny-qwen2_5_vl", slow_bodies=slow_bodies,
                           drip_flood=drip_flood, drip_url=f"{host.base}/drip",
                           source=attacker_address or None))
    finally:
        server.stop()
        host.close()
    latency = doc["valid_latency_s"]
    doc["baseline"] = None if quiet_p99 is None else {
        "path": str(baseline), "p99_s": quiet_p99,
        "p99_ratio": round(latency["p99"] / quiet_p99, 3) if latency.get("p99") else None}
    path = write_result(doc, "soak", out_dir)
    for kind, statuses in sorted(doc["by_kind"].items()):
        out.print(f"  {kind:<22} {dict(statuses)}", markup=False)
    for miss in doc["hostile_mismatches"][:10]:
        out.print(f"  mismatch: {miss}", markup=False)
    out.print(f"requests {doc['requests']}, valid 5xx {doc['valid_5xx']}, hostile mismatches "
              f"{doc['hostile_mismatch_count']}, decode worker restarts "
              f"{doc['decode_worker_restarts']}, RSS growth after warm-up "
              f"{doc['rss_growth_after_warmup']:+.1%}, fd growth {doc['fd_growth_after_warmup']:+d}"
              f", temp leftovers {len(doc['temp_leftovers'])}", markup=False)
    out.print(f"RSS slope over the second half: {doc['rss_slope_second_half_mb_per_min']} MB/min "
              f"(by process: {doc['rss_slope_second_half_by_role_mb_per_min']}); heap in use: "
              f"{doc['heap_in_use_slope_second_half_mb_per_min']} MB/min", markup=False)
    if latency.get("count"):
        out.print(f"valid latency: p50 {latency['median']:.3f} s, p99 {latency['p99']:.3f} s"
                  + (f" ({doc['baseline']['p99_ratio']}x the baseline's {quiet_p99:.3f} s)"
                     if doc["baseline"] else ""), markup=False)
    out.print(f"result: {path}", markup=False)
    ratio = (doc["baseline"] or {}).get("p99_ratio")
    failed = (doc["valid_5xx"] or doc["hostile_mismatches"] or doc["temp_leftovers"]
              or doc["rss_growth_after_warmup"] > max_rss_growth
              or (ratio is not None and ratio > max_p99_ratio))
    raise typer.Exit(1 if failed else 0)
