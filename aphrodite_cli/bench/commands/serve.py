"""``aphrodite bench serve``: end-to-end latency and throughput against an OpenAI-compatible
endpoint."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.bench.commands import flags
from aphrodite_cli.bench.commands.serve_checks import (
    check_ramp_up,
    check_session_flags,
    check_token_flags,
    trace_seconds,
)
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

  aphrodite bench serve --embedded --mode cold --conversation-num 20
  --conversation-turn-mean 4 --conversation-turn-stddev 1 --conversation-turn-delay-mean 500
  --max-concurrency 4     (multi-turn sessions: per-turn TTFT and prefix cache hits)

  aphrodite bench serve --base-url http://gpu-box:8000 --conversation-num 60
  --conversation-turn-mean 5 --num-users 15 --user-centric-rate 1   (AIPerf's user-centric
  mode: each user a turn every 15 s)

  aphrodite bench serve --base-url http://gpu-box:8000 --dataset-name hf
  --dataset-path lmarena-ai/VisionArena-Chat --hf-split train --num-prompts 200
  --metrics-interval 1

vLLM's flags work as given (--dataset-name, --result-dir, --result-filename, --save-result,
--percentile-metrics, --metric-percentiles, --goodput ttft:500 tpot:50, --tokenizer,
--ignore-eos, --temperature, --host/--port, --endpoint, --header, --extra-body); see the
table in docs/benchmarks.md."""


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
    header: flags.Header = None,
    extra_body: flags.ExtraBody = None,
    request_cancellation_rate: flags.CancellationRate = 0.0,
    request_cancellation_delay: flags.CancellationDelay = 0.0,
    admin_api_key: flags.AdminApiKey = None,
    dataset: Annotated[DatasetName, typer.Option(
        "--dataset", "--dataset-name",
        help="random-mm, jsonl, vLLM's random (text only: random-mm with no media), "
             "trace (a timed JSONL replayed at its arrival times: arrival_s, prompt, media, "
             "output_len), vLLM's prefix_repetition (shared prefixes, in tokens), or a "
             "Mooncake trace: mooncake, or vLLM's timed_trace (timestamp, input_length, "
             "output_length, hash_ids: equal ids are equal token blocks), or a public "
             "dataset by name: hf (VisionArena-Chat, MMVU, MMMU, LLaVA-style "
             "conversations) or sharegpt, with --dataset-path.")
    ] = "random-mm",
    dataset_path: Annotated[Path | None, typer.Option(
        help="JSONL file for --dataset jsonl or trace; a Hub id (ORG/NAME) or local folder "
             "for hf; a Hub id or JSON file for sharegpt.")] = None,
    hf_split: flags.HfSplit = "train",
    hf_subset: flags.HfSubset = None,
    hf_output_len: flags.HfOutputLen = None,
    no_stream: flags.NoStream = False,
    media_dir: Annotated[Path | None, typer.Option(help="Folder for media paths in JSONL.")
                         ] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 50,
    num_warmups: flags.NumWarmups = 2,
    request_rate: Annotated[str, typer.Option(help="Requests/s, or inf.")] = "inf",
    burstiness: flags.Burstiness = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    num_workers: Annotated[int, typer.Option(
        min=1, max=256,
        help="Client processes sending each phase (one shared schedule, --max-concurrency "
             "held across all of them, the records merged): for targets one event loop "
             "cannot keep busy. Not with multi-turn sessions.")] = 1,
    seed: flags.Seed = 0,
    mode: flags.Mode = "both",
    media_delivery: flags.MediaDelivery = "data-url",
    items_per_request: flags.ItemsPerRequest = 1,
    bucket_config: flags.BucketConfig = None,
    prompt_len: flags.PromptLen = 32,
    random_input_len: flags.RandomInputLen = None,
    output_len: flags.OutputLen = 16,
    random_range_ratio: flags.RandomRangeRatio = 0.0,
    prefix_repetition_prefix_len: flags.PrefixLen = 256,
    prefix_repetition_suffix_len: flags.SuffixLen = 256,
    prefix_repetition_num_prefixes: flags.NumPrefixes = 10,
    prefix_repetition_output_len: flags.PrefixOutputLen = 128,
    trace_time_scale: flags.TraceTimeScale = 1.0,
    timed_trace_sec_multiplier: flags.TimedTraceSecMultiplier = None,
    timed_trace_chunk_hash_size: flags.TimedTraceChunk = 512,
    image_format: Annotated[str, typer.Option(help="JPEG, PNG or WEBP.")] = "JPEG",
    image_quality: Annotated[int, typer.Option(min=1, max=100)] = 90,
    video_codec: Annotated[str, typer.Option()] = "libx264",
    video_fps: Annotated[int, typer.Option(min=1)] = 30,
    video_gop: Annotated[int, typer.Option(min=1)] = 30,
    goodput: Annotated[str | None, typer.Option(
        help="SLOs in ms: ttft:200,tpot:50 or vLLM's ttft:200 tpot:50 (e2el = e2e).")] = None,
    percentile_metrics: Annotated[str, typer.Option(
        help="Metrics whose percentiles are printed and stored as vLLM's p{N}_{metric}_ms "
             "fields: ttft, tpot, itl, e2el, ttst (time to second token).")
    ] = "ttft,tpot,itl,e2el,ttst",
    metric_percentiles: Annotated[str, typer.Option(
        help="Those percentiles, e.g. 50,90,99.")] = "50,99",
    tokenizer: Annotated[str | None, typer.Option(
        help="A tokenizer (folder or hub id): writes --random-input-len and prefix_repetition "
             "prompts in its tokens, and counts output tokens when the target reports no "
             "usage, instead of counting stream chunks.")] = None,
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
    metrics_interval: flags.MetricsInterval = None,
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
    conversation_num: Annotated[int | None, typer.Option(
        "--conversation-num", "--num-conversations", "--num-sessions",
        help="AIPerf's multi-turn sessions: this many per phase (instead of --num-prompts). "
             "Each later turn resends the history: the first message with its media, the "
             "server's answers, a new user text.")] = None,
    conversation_turn_mean: Annotated[float, typer.Option(
        "--conversation-turn-mean", "--session-turns-mean",
        help="Turns per session: mean of a normal draw, rounded, at least 1 (seeded by "
             "--seed).")] = 1.0,
    conversation_turn_stddev: Annotated[float, typer.Option(
        "--conversation-turn-stddev", "--session-turns-stddev",
        help="Turns per session: standard deviation (0: every session has the mean).")
    ] = 0.0,
    conversation_turn_delay_mean: Annotated[float, typer.Option(
        "--conversation-turn-delay-mean",
        help="Milliseconds between a turn's answer and the session's next turn (mean).")
    ] = 0.0,
    conversation_turn_delay_stddev: Annotated[float, typer.Option(
        "--conversation-turn-delay-stddev",
        help="Milliseconds between turns: standard deviation (draws below 0 are 0).")] = 0.0,
    num_users: Annotated[int | None, typer.Option(
        help="AIPerf's user-centric mode (with --user-centric-rate): this many users, each "
             "working through sessions.")] = None,
    user_centric_rate: Annotated[float | None, typer.Option(
        help="Requests/s over all --num-users users: each user sends a turn every "
             "num-users / rate seconds, start to start (a late answer: at once).")] = None,
) -> None:
    """End-to-end latency and throughput of a chat endpoint, cold media and warm cache."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from aphrodite_cli.bench.data.datasets import parse_buckets
    from aphrodite_cli.bench.load import vllm_compat, wire
    from aphrodite_cli.bench.load.archetypes import parse_archetypes
    from aphrodite_cli.bench.load.client import ArrivalConfig, LoadConfig, MediaConfig, TargetConfig
    from aphrodite_cli.bench.load.hub_datasets import HubArgs
    from aphrodite_cli.bench.load.serve import ServeArgs, TokenArgs, run
    from aphrodite_cli.bench.load.target import Target
    from aphrodite_cli.bench.results.escape import printable
    from aphrodite_cli.bench.results.files import write_result
    from engine.errors import ConfigError

    say = err if output_format == "json" else out  # stdout carries only the JSON then
    goodput_parts = [goodput] if goodput else []
    header_items = list(header or [])
    stray = []
    for arg in ctx.args:  # vLLM's nargs: --goodput ttft:500 tpot:50, --header a=1 b=2
        if goodput and re.fullmatch(r"[A-Za-z0-9]+:[0-9.]+", arg):
            goodput_parts.append(arg)
        elif header_items and "=" in arg and not arg.startswith("-"):
            header_items.append(arg)
        else:
            stray.append(arg)
    if stray:
        raise ConfigError(f"unexpected argument(s): {' '.join(stray)}",
                          hint="every value needs its flag (see --help)", code="invalid_flag")
    headers = wire.parse_headers(header_items, api_key)
    body_extra = wire.parse_extra_body(extra_body)
    for flag, value in (("--request-cancellation-rate", request_cancellation_rate),
                        ("--request-cancellation-delay", request_cancellation_delay)):
        if not math.isfinite(value):  # a range check lets inf through
            raise ConfigError(f"{flag} {value} is not a finite number", code="invalid_flag")
    target = Target(base_url, host=host, port=port, embedded=embedded, model=model,
                    engine=server_engine, api_key=api_key, headers=headers,
                    announce=lambda msg: say.print(printable(msg), markup=False))
    if dataset == "random":  # vLLM's text-only random dataset
        dataset, items_per_request = "random-mm", 0
    if dataset in ("prefix_repetition", "mooncake", "timed_trace"):
        items_per_request = 0  # text only, as vLLM's
    if endpoint is None:
        backends = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions",
                    "vllm": "/v1/completions", None: "/v1/chat/completions"}
        if backend not in backends:
            raise ConfigError(f"--backend {backend!r} is not one of openai-chat, openai, vllm",
                              code="invalid_flag")
        endpoint = backends[backend]
    if not endpoint.rstrip("/").endswith("chat/completions") and (
            items_per_request > 0 or dataset in ("jsonl", "trace", "hf", "sharegpt")):
        raise ConfigError(f"--endpoint {endpoint} takes text prompts only, so it cannot carry "
                          "media", hint="use /v1/chat/completions, or --items-per-request 0 "
                          "(--dataset-name random)", code="invalid_flag")
    try:
        rate = math.inf if request_rate.lower() == "inf" else float(request_rate)
    except ValueError:
        raise ConfigError(f"--request-rate {request_rate!r} is a number or inf",
                          code="invalid_flag") from None
    check_ramp_up(ramp_up_strategy, ramp_up_start_rps, ramp_up_end_rps, rate)
    check_token_flags(dataset, random_input_len, random_range_ratio, archetypes)
    sessions = check_session_flags(
        conversation_num=conversation_num, turn_mean=conversation_turn_mean,
        turn_stddev=conversation_turn_stddev, delay_mean=conversation_turn_delay_mean,
        delay_stddev=conversation_turn_delay_stddev, num_users=num_users,
        user_centric_rate=user_centric_rate, request_rate=rate,
        ramp_up_strategy=ramp_up_strategy, dataset=dataset, endpoint=endpoint)
    if num_workers > 1 and sessions is not None:
        raise ConfigError("--num-workers splits one schedule of single requests; multi-turn "
                          "sessions (--conversation-num) run in one process",
                          hint="leave --num-workers out", code="invalid_flag")
    if dataset in ("jsonl", "trace", "mooncake", "timed_trace") and dataset_path is None:
        raise ConfigError(f"--dataset-name {dataset} needs --dataset-path FILE.jsonl",
                          code="invalid_flag")
    if dataset in ("hf", "sharegpt") and dataset_path is None:
        raise ConfigError(f"--dataset-name {dataset} needs --dataset-path ORG/NAME (a Hub "
                          "dataset id)", code="invalid_flag")
    if not math.isfinite(trace_time_scale):
        raise ConfigError(f"--trace-time-scale {trace_time_scale} is not finite",
                          code="invalid_flag")
    slos = vllm_compat.parse_goodput(goodput_parts)
    pct_metrics = vllm_compat.parse_list("--percentile-metrics", percentile_metrics,
                                         set(vllm_compat.METRICS))
    pcts = vllm_compat.parse_percentiles(metric_percentiles)
    # base_url and model: the target's, once it is open (run)
    cfg = LoadConfig(
        target=TargetConfig(base_url="", endpoint="/" + endpoint.lstrip("/"), api_key=api_key,
                            admin_api_key=admin_api_key, headers=headers,
                            extra_body=body_extra),
        arrivals=ArrivalConfig(request_rate=rate, burstiness=burstiness,
                               max_concurrency=max_concurrency,
                               ramp_up_strategy=ramp_up_strategy,
                               ramp_up_start_rps=ramp_up_start_rps,
                               ramp_up_end_rps=ramp_up_end_rps,
                               cancel_rate=request_cancellation_rate,
                               cancel_delay_s=request_cancellation_delay,
                               num_workers=num_workers),
        media=MediaConfig(media_delivery=media_delivery, image_format=image_format.upper(),
                          image_quality=image_quality, video_codec=video_codec,
                          video_fps=video_fps, video_gop=video_gop),
        abort_after=abort_after_failures, seed=seed, goodput=slos, temperature=temperature,
        ignore_eos=ignore_eos, timeout_s=request_timeout, keep_text=tokenizer is not None,
        max_response_bytes=int(max_response_mb * (1 << 20)), ttft_from=ttft_from)
    args = ServeArgs(dataset=dataset, dataset_path=dataset_path, media_dir=media_dir,
                     num_prompts=num_prompts, num_warmups=num_warmups, mode=mode,
                     items_per_request=items_per_request, buckets=parse_buckets(bucket_config),
                     prompt_len=prompt_len, output_len=output_len, seed=seed,
                     tokens=TokenArgs(input_len=random_input_len, range_ratio=random_range_ratio,
                                      prefix_len=prefix_repetition_prefix_len,
                                      suffix_len=prefix_repetition_suffix_len,
                                      num_prefixes=prefix_repetition_num_prefixes,
                                      prefix_output_len=prefix_repetition_output_len,
                                      tokenizer=tokenizer,
                                      trace_block=timed_trace_chunk_hash_size,
                                      trace_seconds_per_unit=trace_seconds(
                                          dataset, trace_time_scale,
                                          timed_trace_sec_multiplier)),
                     trace_time_scale=trace_time_scale,
                     hub=HubArgs(split=hf_split, subset=hf_subset, output_len=hf_output_len,
                                 stream=not no_stream),
                     embedded=embedded, embedded_engine=server_engine,
                     percentile_metrics=tuple(pct_metrics),
                     metric_percentiles=tuple(pcts),
                     tokenizer=vllm_compat.load_tokenizer(tokenizer) if tokenizer else None,
                     reset_caches=reset_caches, probe_request_rate=probe_request_rate,
                     slice_seconds=slice_seconds, server_cpu=server_cpu,
                     metrics_interval=metrics_interval,
                     archetypes=parse_archetypes(archetypes), num_runs=num_runs,
                     sessions=sessions)
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


def _print_serve_table(doc: dict, fmt: str = "table") -> None:
    metrics = doc.get("percentile_metrics") or ["ttft", "tpot", "itl", "e2el"]
    pcts = doc.get("metric_percentiles") or [50.0, 99.0]
    # requests the run cancelled itself (--request-cancellation-rate): apart from failures
    cancels = any(p.get("cancelled") for p in doc["phases"].values()) or bool(
        (doc.get("config") or {}).get("cancel_rate"))
    columns = ["phase", "ok/failed", *(["cancelled"] if cancels else []), "req/s",
               "in tok/s", "out tok/s", "total tok/s", "out tok/s/user p50",
               *(f"{m.upper()} {'/'.join(f'p{p:g}' for p in pcts)} ms" for m in metrics),
               "cache hit", "prefix hit"]

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for mode, p in doc["phases"].items():
        hit = p["server_cache"]["hit_rate"]
        prefix = (p.get("prefix_cache") or {}).get("hit_rate")
        cells = ["/".join(num(p.get(f"p{q:g}_{m}_ms"), ".1f") for q in pcts) for m in metrics]
        rows.append([mode, f"{p['completed']}/{p['failed']}",
                     *([str(p.get("cancelled", 0))] if cancels else []),
                     f"{p['request_throughput']:.2f}", num(p.get("input_token_throughput"), ".1f"),
                     f"{p['output_throughput']:.1f}", num(p.get("total_token_throughput"), ".1f"),
                     num((p.get("output_token_throughput_per_user") or {}).get("median"), ".1f"),
                     *cells, num(hit, ".0%"), num(prefix, ".0%")])
    sessions = doc.get("sessions")
    title = (f"{sessions['conversation_num']} multi-turn sessions per phase" if sessions
             else f"{doc['num_prompts']} prompts per phase")
    print_table(f"bench serve: {title}", columns, rows, fmt)
