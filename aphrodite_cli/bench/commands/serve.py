"""``aphrodite bench serve``: end-to-end latency and throughput against an OpenAI-compatible
endpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.bench.commands import flags
from aphrodite_cli.bench.commands.serve_extras import print_phase_extras
from aphrodite_cli.options import DatasetName, RampUpStrategy
from aphrodite_cli.output import err, out, print_table

#: ``aphrodite bench serve --help``'s epilog.
EXAMPLES = """Examples:

  aphrodite bench serve --embedded --num-prompts 50 --mode both

  aphrodite bench serve --base-url http://gpu-box:8000 --model Qwen/Qwen2.5-VL-7B-Instruct
  --request-rate 4 --burstiness 0.5 --max-concurrency 16 --media-delivery http
  --bucket-config '{"720,1280,1": 0.7, "360,640,32": 0.3}' --goodput ttft:500,tpot:50

  aphrodite bench serve --base-url http://localhost:2242/v1 --dataset jsonl
  --dataset-path requests.jsonl --media-dir ./media --csv

vLLM's flags work as given (--dataset-name, --result-dir, --result-filename, --save-result,
--percentile-metrics, --metric-percentiles, --goodput ttft:500 tpot:50, --tokenizer,
--ignore-eos, --temperature, --host/--port, --endpoint); see the README's table."""


def serve_cmd(
    ctx: typer.Context,
    base_url: flags.BaseUrl = None,
    host: flags.Host = None,
    port: flags.Port = None,
    endpoint: flags.Endpoint = None,
    backend: Annotated[str | None, typer.Option(
        help="vLLM's --backend: openai-chat (/v1/chat/completions) or openai/vllm "
             "(/v1/completions), when --endpoint is not given.")] = None,
    embedded: flags.Embedded = False,
    server_engine: flags.EmbeddedEngine = "aphrodite",
    model: flags.Model = None,
    api_key: flags.ApiKey = None,
    admin_api_key: flags.AdminApiKey = None,
    dataset: Annotated[DatasetName, typer.Option(
        "--dataset", "--dataset-name",
        help="random-mm, jsonl, vLLM's random (text only: random-mm with no media), or "
             "trace (a timed JSONL replayed at its arrival times: arrival_s, prompt, media, "
             "output_len).")
    ] = "random-mm",
    dataset_path: Annotated[Path | None, typer.Option(
        help="JSONL file for --dataset jsonl or trace.")] = None,
    media_dir: Annotated[Path | None, typer.Option(help="Folder for media paths in JSONL.")
                         ] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 50,
    num_warmups: flags.NumWarmups = 2,
    request_rate: Annotated[str, typer.Option(help="Requests/s, or inf.")] = "inf",
    burstiness: flags.Burstiness = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    seed: flags.Seed = 0,
    mode: flags.Mode = "both",
    media_delivery: flags.MediaDelivery = "data-url",
    items_per_request: flags.ItemsPerRequest = 1,
    bucket_config: flags.BucketConfig = None,
    prompt_len: flags.PromptLen = 32,
    output_len: flags.OutputLen = 16,
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
    output_format: flags.OutputFormat = "table",
    max_failure_rate: flags.MaxFailureRate = 0.0,
    abort_after_failures: Annotated[int, typer.Option(
        min=0, help="Stop at once (exit 1) when the first this-many answers are all the same "
                    "4xx, as a wrong URL, model or key gives; 0: never.")] = 5,
    out_dir: flags.OutDir = Path("results"),
    reset_caches: flags.ResetCaches = True,
    server_cpu: flags.ServerCpu = True,
    probe_request_rate: flags.ProbeRequestRate = None,
    slice_seconds: flags.SliceSeconds = None,
    archetypes: flags.Archetypes = None,
    num_runs: flags.NumRuns = 1,
    request_timeout: flags.RequestTimeout = 300.0,
    ramp_up_strategy: Annotated[RampUpStrategy | None, typer.Option(
        help="vLLM's ramp-up: the request rate goes from --ramp-up-start-rps to "
             "--ramp-up-end-rps over each phase's requests, linear or exponential (instead "
             "of --request-rate).")] = None,
    ramp_up_start_rps: Annotated[float | None, typer.Option(
        help="The ramp's first rate (requests/s; above 0 for exponential).")] = None,
    ramp_up_end_rps: Annotated[float | None, typer.Option(
        help="The ramp's last rate (requests/s).")] = None,
    max_response_mb: flags.MaxResponseMb = 16.0,
    ttft_from: flags.TtftFrom = "content",
) -> None:
    """End-to-end latency and throughput of a chat endpoint, cold media and warm cache."""
    import math

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from aphrodite_cli.bench.load import vllm_compat
    from aphrodite_cli.bench.load.archetypes import parse_archetypes
    from aphrodite_cli.bench.load.client import LoadConfig
    from aphrodite_cli.bench.load.datasets import parse_buckets
    from aphrodite_cli.bench.load.escape import printable
    from aphrodite_cli.bench.load.serve import ServeArgs, run
    from aphrodite_cli.bench.load.target import Target
    from aphrodite_cli.bench.results.files import write_result
    from engine.errors import ConfigError

    say = err if output_format == "json" else out  # stdout carries only the JSON then
    target = Target(base_url, host=host, port=port, embedded=embedded, model=model,
                    engine=server_engine, api_key=api_key,
                    announce=lambda msg: say.print(printable(msg), markup=False))
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
            items_per_request > 0 or dataset in ("jsonl", "trace")):
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
    check_ramp_up(ramp_up_strategy, ramp_up_start_rps, ramp_up_end_rps, rate)
    slos = vllm_compat.parse_goodput(goodput_parts)
    pct_metrics = vllm_compat.parse_list("--percentile-metrics", percentile_metrics,
                                         set(vllm_compat.METRICS))
    pcts = vllm_compat.parse_percentiles(metric_percentiles)
    # base_url and model: the target's, once it is open (run)
    cfg = LoadConfig(base_url="", endpoint="/" + endpoint.lstrip("/"),
                     abort_after=abort_after_failures, api_key=api_key,
                     admin_api_key=admin_api_key, request_rate=rate,
                     burstiness=burstiness,
                     max_concurrency=max_concurrency, seed=seed, media_delivery=media_delivery,
                     image_format=image_format.upper(), image_quality=image_quality,
                     video_codec=video_codec, video_fps=video_fps, video_gop=video_gop,
                     goodput=slos, temperature=temperature, ignore_eos=ignore_eos,
                     timeout_s=request_timeout, keep_text=tokenizer is not None,
                     ramp_up_strategy=ramp_up_strategy,
                     ramp_up_start_rps=ramp_up_start_rps, ramp_up_end_rps=ramp_up_end_rps,
                     max_response_bytes=int(max_response_mb * (1 << 20)),
                     ttft_from=ttft_from)
    args = ServeArgs(dataset=dataset, dataset_path=dataset_path, media_dir=media_dir,
                     num_prompts=num_prompts, num_warmups=num_warmups, mode=mode,
                     items_per_request=items_per_request, buckets=parse_buckets(bucket_config),
                     prompt_len=prompt_len, output_len=output_len, seed=seed,
                     embedded=embedded, embedded_engine=server_engine,
                     percentile_metrics=tuple(pct_metrics),
                     metric_percentiles=tuple(pcts),
                     tokenizer=vllm_compat.load_tokenizer(tokenizer) if tokenizer else None,
                     reset_caches=reset_caches, probe_request_rate=probe_request_rate,
                     slice_seconds=slice_seconds, server_cpu=server_cpu,
                     archetypes=parse_archetypes(archetypes), num_runs=num_runs)
    from aphrodite_cli.bench.load.client import TargetRefused
    from engine.errors import BenchmarkFailed

    try:
        # progress on stderr, and only on a terminal: logs and pipes get the results alone
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                      disable=not err.is_terminal) as progress:
            doc, rows = run(cfg, args, target, progress)
    except TargetRefused as refused:
        first = refused.records[0]
        raise BenchmarkFailed(
            f"the first {len(refused.records)} requests to {refused.url} all got HTTP "
            f"{first.status} ({first.error}); the run was stopped. The target said: "
            f"{(first.error_body or '').strip()[:300]}",
            hint="check --base-url/--endpoint, --model and --api-key "
                 "(--abort-after-failures 0 runs on regardless)") from None
    doc["percentile_metrics"], doc["metric_percentiles"] = pct_metrics, pcts
    doc["tokenizer"] = tokenizer
    # vLLM's result fields for its ramp-up
    doc.update(ramp_up_strategy=ramp_up_strategy, ramp_up_start_rps=ramp_up_start_rps,
               ramp_up_end_rps=ramp_up_end_rps)
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
    print_phase_extras(doc, output_format, say)
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


def check_ramp_up(strategy: str | None, start: float | None, end: float | None,
                  rate: float) -> None:
    """vLLM's rules for --ramp-up-strategy and its rates, as one-line errors."""
    import math

    from engine.errors import ConfigError

    if strategy is None:
        if start is not None or end is not None:
            raise ConfigError("--ramp-up-start-rps/--ramp-up-end-rps need --ramp-up-strategy "
                              "linear or exponential", code="invalid_flag")
        return
    if not math.isinf(rate):
        raise ConfigError("--ramp-up-strategy sets the request rate itself",
                          hint="drop --request-rate", code="invalid_flag")
    if start is None or end is None:
        raise ConfigError("--ramp-up-strategy needs both --ramp-up-start-rps and "
                          "--ramp-up-end-rps", code="invalid_flag")
    if start < 0 or end < 0 or start > end or (end == 0):
        raise ConfigError(f"--ramp-up-start-rps {start:g} and --ramp-up-end-rps {end:g}: the "
                          "rates are non-negative, the start at most the end, the end above 0",
                          code="invalid_flag")
    if strategy == "exponential" and start == 0:
        raise ConfigError("an exponential ramp cannot start at 0 requests/s",
                          hint="--ramp-up-start-rps above 0, or --ramp-up-strategy linear",
                          code="invalid_flag")


def _print_serve_table(doc: dict, fmt: str = "table") -> None:
    metrics = doc.get("percentile_metrics") or ["ttft", "tpot", "itl", "e2el"]
    pcts = doc.get("metric_percentiles") or [50.0, 99.0]
    columns = ["phase", "ok/failed", "req/s", "out tok/s",
               *(f"{m.upper()} {'/'.join(f'p{p:g}' for p in pcts)} ms" for m in metrics),
               "cache hit", "prefix hit"]
    rows = []
    for mode, p in doc["phases"].items():
        hit = p["server_cache"]["hit_rate"]
        prefix = (p.get("prefix_cache") or {}).get("hit_rate")
        cells = ["/".join("-" if p.get(f"p{q:g}_{m}_ms") is None else
                          f"{p[f'p{q:g}_{m}_ms']:.1f}" for q in pcts) for m in metrics]
        rows.append([mode, f"{p['completed']}/{p['failed']}", f"{p['request_throughput']:.2f}",
                     f"{p['output_throughput']:.1f}", *cells,
                     "-" if hit is None else f"{hit:.0%}",
                     "-" if prefix is None else f"{prefix:.0%}"])
    print_table(f"bench serve: {doc['num_prompts']} prompts per phase", columns, rows, fmt)
