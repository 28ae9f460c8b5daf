"""Orchestration of `bench serve`: dataset -> payloads -> phases (cold, warm) -> result."""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.data.datasets import (
    BenchRequest,
    load_jsonl,
    nonce,
    random_mm,
)
from aphrodite_cli.bench.harness.media_host import MediaHost
from aphrodite_cli.bench.load.client import (
    LoadConfig,
    build_payload,
    document,
    phase_result,
)
from aphrodite_cli.bench.load.hub_datasets import HubArgs
from aphrodite_cli.bench.load.observe import PhaseWatch
from aphrodite_cli.bench.load.target import Target
from aphrodite_cli.bench.load.vllm_compat import count_tokens, flat_fields
from aphrodite_cli.bench.load.workers import run_phase
from aphrodite_cli.bench.results.fields import stage_ms
from aphrodite_cli.options import DatasetName, Mode
from engine.errors import ConfigError
from engine.timings import SERVED_STAGES


@dataclass(frozen=True)
class TokenArgs:
    """Prompts counted in tokens (see :mod:`aphrodite_cli.bench.load.token_prompts`):
    ``--random-input-len`` and ``--random-range-ratio``, vLLM's prefix_repetition dataset,
    and the tokenizer named by ``--tokenizer`` (None: the target's model);
    ``prompts`` once the target is open."""

    input_len: int | None = None  # --random-input-len (None: prompts in words)
    range_ratio: float = 0.0  # --random-range-ratio
    # --prefix-repetition-prefix-len, -suffix-len, -num-prefixes, -output-len (vLLM's defaults)
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128
    tokenizer: str | None = None  # --tokenizer
    prompts: Any = None  # a token_prompts.TokenPrompts, once the target is open
    # a Mooncake trace's block size (--timed-trace-chunk-hash-size) and seconds per timestamp
    # unit (0.001 x --trace-time-scale, or --timed-trace-sec-multiplier)
    trace_block: int = 512
    trace_seconds_per_unit: float = 0.001


#: Datasets whose requests carry their own arrival times; Mooncake's in tokens
TIMED = ("trace", "mooncake", "timed_trace")
MOONCAKE = ("mooncake", "timed_trace")
#: Public datasets by name, read with Hugging Face's ``datasets`` (load/hub_datasets.py)
NAMED = ("hf", "sharegpt")


@dataclass(frozen=True)
class ServeArgs:
    """What ``bench serve`` sends and how (the load itself is a :class:`LoadConfig`),
    resolved from the flags once."""

    num_prompts: int
    buckets: dict
    dataset: DatasetName = "random-mm"
    dataset_path: Path | None = None
    media_dir: Path | None = None
    num_warmups: int = 0
    mode: Mode = "cold"
    items_per_request: int = 1
    prompt_len: int = 8
    output_len: int = 16
    seed: int = 0
    #: the target is this project's server, started for the run (see :class:`Target`)
    embedded: bool = False
    #: the embedded server's engine (``serve --engine``)
    embedded_engine: str = "aphrodite"
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    metric_percentiles: tuple[float, ...] = (99.0,)
    #: counts tokens client-side when the target reports no usage
    tokenizer: Any = None
    #: what is watched around each phase (see :mod:`aphrodite_cli.bench.load.observe`)
    reset_caches: bool = True
    scrape_metrics: bool = True
    probe_request_rate: float | None = None
    slice_seconds: float | None = None
    metrics_interval: float | None = None  # --metrics-interval (load/telemetry.py)
    server_cpu: bool = True
    archetypes: dict | None = None
    num_runs: int = 1  # the phases this many times, with run-to-run intervals (results/runs.py)
    tokens: TokenArgs = TokenArgs()
    trace_time_scale: float = 1.0  # --trace-time-scale: a trace's gaps times this
    #: multi-turn sessions (--conversation-num ...; see load/sessions.py); None: one turn each
    sessions: Any = None
    #: --dataset-name hf / sharegpt: --hf-split, --hf-subset, --hf-output-len, --no-stream
    hub: HubArgs = field(default_factory=HubArgs)

    @property
    def in_tokens(self) -> bool:
        """Whether prompts are written in tokens (and need a tokenizer)."""
        return self.tokens.input_len is not None or self.dataset in ("prefix_repetition",
                                                                     *MOONCAKE)


def make_dataset(args: ServeArgs, *, run_nonce: int) -> list[BenchRequest]:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ConfigError("--dataset jsonl needs --dataset-path FILE")
        rows = load_jsonl(Path(args.dataset_path), args.media_dir)
        return (rows * (args.num_prompts // max(len(rows), 1) + 1))[: args.num_prompts]
    if args.dataset in NAMED:
        from aphrodite_cli.bench.load.hub_datasets import load_named

        return load_named(args.dataset, str(args.dataset_path), args.hub,
                          num_prompts=args.num_prompts, output_len=args.output_len,
                          media_dir=args.media_dir)
    if args.dataset == "trace":
        from aphrodite_cli.bench.load.trace import load_trace

        if not args.dataset_path:
            raise ConfigError("--dataset-name trace needs --dataset-path FILE.jsonl")
        rows = load_trace(Path(args.dataset_path), args.media_dir, limit=args.num_prompts,
                          nonce=run_nonce)
        return [replace(r, arrival_s=(r.arrival_s or 0.0) * args.trace_time_scale)
                for r in rows]
    if args.in_tokens:
        return _token_dataset(args, run_nonce)
    if args.archetypes:
        from aphrodite_cli.bench.load.archetypes import archetype_dataset

        return archetype_dataset(args.num_prompts, args.archetypes, buckets=args.buckets,
                                 prompt_len=args.prompt_len, output_len=args.output_len,
                                 seed=args.seed, nonce=run_nonce)
    return random_mm(args.num_prompts, items=args.items_per_request, buckets=args.buckets,
                     prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed,
                     nonce=run_nonce)


def _token_dataset(args: ServeArgs, run_nonce: int) -> list[BenchRequest]:
    from aphrodite_cli.bench.load import token_prompts

    t = args.tokens
    if args.dataset in MOONCAKE:
        from aphrodite_cli.bench.load.mooncake import load_mooncake

        if not args.dataset_path:
            raise ConfigError(f"--dataset-name {args.dataset} needs --dataset-path FILE.jsonl",
                              code="invalid_flag")
        return load_mooncake(Path(args.dataset_path), t.prompts, block=t.trace_block,
                             seconds_per_unit=t.trace_seconds_per_unit, limit=args.num_prompts,
                             seed=args.seed, nonce=run_nonce)
    if args.dataset == "prefix_repetition":
        texts = token_prompts.prefix_repetition_requests(
            t.prompts, args.num_prompts, prefix_len=t.prefix_len, suffix_len=t.suffix_len,
            num_prefixes=t.num_prefixes, seed=args.seed, nonce=run_nonce)
        length = t.prefix_len + t.suffix_len + t.prompts.overhead
        return [BenchRequest(text, [], t.prefix_output_len, input_len=length) for text in texts]
    pairs = token_prompts.random_token_requests(
        t.prompts, args.num_prompts, input_len=t.input_len, output_len=args.output_len,
        range_ratio=t.range_ratio, seed=args.seed, nonce=run_nonce)
    media = random_mm(args.num_prompts, items=args.items_per_request, buckets=args.buckets,
                      prompt_len=1, output_len=1, seed=args.seed, nonce=run_nonce)
    return [replace(req, prompt=text, input_len=length, output_len=out)
            for req, (text, length, out) in zip(media, pairs, strict=True)]


def request_rows(phase: str, records: list, dataset: list[BenchRequest] | None = None
                 ) -> list[dict[str, Any]]:
    """One row per request, every time in ms: its index and send time (ms after the
    phase's first send), status and error, every metric, its ITL gaps, the server's
    stage timings (``server_<stage>_ms``) when the target reports them, and the prompt
    tokens asked for (``input_len``, vLLM's name) when prompts are written in tokens."""
    first = min((r.sent_at for r in records if r.sent_at), default=0.0)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    asked = [req.input_len for req in dataset] if dataset else [None] * len(records)
    rows = []
    for r, input_len in zip(records, asked, strict=True):
        timings = (r.server or {}).get("timings") or {}
        rows.append({
            "phase": phase, "index": r.index, "sent_ms": ms(r.sent_at - first) if r.sent_at
            else None, "ok": r.ok, "cancelled": r.cancelled, "status": r.status,
            "error": r.error,
            "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot), "e2e_ms": ms(r.e2e),
            "ttst_ms": ms(r.ttst), "output_token_throughput_per_user":
            None if r.tokens_per_s_per_user is None else round(r.tokens_per_s_per_user, 3),
            "itl_ms": [ms(g) for g in r.itl], "output_tokens": r.output_tokens,
            "output_tokens_from": r.token_source, "input_len": input_len,
            "prompt_tokens": r.prompt_tokens,
            "request_bytes": r.request_bytes, "encode_ms": ms(r.encode_s),
            **{f"server_{k.removeprefix('server_').removesuffix('_s')}_ms": ms(float(v))
               for k, v in timings.items() if k.endswith("_s") and isinstance(v, int | float)}})
    return rows


def _embedded_server(args: ServeArgs) -> str | None:
    """What the result file says the embedded server was (None: an outside target)."""
    if not args.embedded:
        return None
    if args.embedded_engine == "vllm":
        return "aphrodite serve --engine vllm (vLLM's engine and processor behind this front door)"
    from engine import envs
    from engine.config import PipelineConfig

    return (f"aphrodite serve (tiny Qwen2.5-VL, video backend "
            f"{envs.APHRODITE_VIDEO_LOADER_BACKEND}, processor cache "
            f"{PipelineConfig.mm_processor_cache_gb:g} GB)")


async def run_serve(cfg: LoadConfig, args: ServeArgs, progress: Any,
                    model_source: str = "--model"
                    ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The phases against ``cfg``'s target: (the result, its per-request rows by phase)."""
    host = MediaHost() if cfg.media.media_delivery == "http" else None
    cache: dict = {}
    phases: dict[str, Any] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        modes = ("cold", "warm") if args.mode == "both" else (args.mode,)
        for mode in modes:
            run_nonce = nonce() if mode == "cold" else args.seed + 7919
            warmups = [build_payload(r, cfg, host, cache) for r in make_dataset(
                replace(args, num_prompts=args.num_warmups), run_nonce=nonce())
            ] if args.num_warmups else []
            # unmeasured sends: all at once, none cancelled (a warm phase's media must land)
            unmeasured = cfg.with_arrivals(request_rate=math.inf, ramp_up_strategy=None,
                                           cancel_rate=0.0)
            if warmups:  # server warm-up (JIT, pools): never measured
                await run_phase(warmups, unmeasured)
            if args.sessions is not None:
                records, duration, send_rate, dataset, turns, watch = await _session_phase(
                    cfg, args, mode, run_nonce, host, cache, progress, unmeasured)
            else:
                dataset = make_dataset(args, run_nonce=run_nonce)
                payloads = [build_payload(r, cfg, host, cache) for r in dataset]
                if mode == "warm":  # the same media, sent once before measuring: unmeasured
                    await run_phase(payloads, unmeasured)
                task = progress.add_task(f"{mode} phase", total=len(payloads))
                async with _watch(cfg, args, mode) as watch:
                    records, duration, send_rate = await run_phase(
                        payloads, cfg, on_done=lambda t=task: progress.advance(t),
                        times=[r.arrival_s or 0.0 for r in dataset] if args.dataset in TIMED
                        else None)
                turns = None
            if args.tokenizer is not None:
                count_tokens(args.tokenizer, records)
            result = phase_result(records, duration, send_rate, cfg)
            watch.annotate(result, dataset, records, duration)
            hit_rate = result["server_cache"]["hit_rate"]
            if turns is not None:  # sessions: only first turns claim the phase's state
                result["per_turn"] = turns.result(result.get("server_metrics"))
                hit_rate = turns.first_turn_hit_rate
            result["cache_check"] = None
            if hit_rate is not None:
                want = 1.0 if mode == "warm" else 0.0
                result["cache_check"] = "ok" if abs(hit_rate - want) <= 0.01 else (
                    f"FAILED: {mode} phase measured a server cache hit rate of {hit_rate:.0%}")
            result["samples"] = {
                "ttft_ms": [r.ttft * 1e3 for r in records if r.ok and r.ttft is not None],
                "itl_ms": [gap * 1e3 for r in records if r.ok for gap in r.itl],
                "tpot_ms": [r.tpot * 1e3 for r in records if r.tpot is not None],
                "e2e_ms": [r.e2e * 1e3 for r in records if r.ok and r.e2e is not None],
                "ttst_ms": [t * 1e3 for r in records if (t := r.ttst) is not None],
                "output_token_throughput_per_user": [
                    v for r in records if (v := r.tokens_per_s_per_user) is not None],
                "pixels": [sum(m.width * m.height * m.frames for m in req.media)
                           for req, r in zip(dataset, records, strict=True) if r.ok],
                "stages_ms": {stage_ms(k): [v for r in records if r.ok if math.isfinite(
                    v := float(((r.server or {}).get("timings") or {}).get(k, 0)) * 1e3)
                    and v >= 0] for k in SERVED_STAGES},  # a target's figures, as it sent them
            }
            result.update(flat_fields(result, list(args.percentile_metrics),
                                      list(args.metric_percentiles)))
            phases[mode] = result
            rows[mode] = request_rows(mode, records, dataset)
            if turns is not None:
                turns.label(rows[mode])
    finally:
        if host:
            host.stop()
    media = {"items_per_request": args.items_per_request,
             "buckets": {",".join(map(str, k)): v for k, v in args.buckets.items()},
             "image_format": cfg.media.image_format, "image_quality": cfg.media.image_quality,
             "video_codec": cfg.media.video_codec, "video_fps": cfg.media.video_fps,
             "video_gop": cfg.media.video_gop}
    doc = document(cfg, phases, {"dataset": args.dataset, "num_prompts": args.num_prompts,
                                 "num_warmups": args.num_warmups, "mode": args.mode,
                                 "media": media, "embedded": args.embedded,
                                 "model_source": model_source,
                                 **_named_settings(args),
                                 "target": {"base_url": cfg.target.base_url,
                                            "endpoint": cfg.target.endpoint,
                                            "embedded_server": _embedded_server(args)},
                                 "pid": os.getpid(),
                                 "input_tokens": _token_settings(args),
                                 "sessions": args.sessions.describe() if args.sessions
                                 else None})
    return doc, rows


def _watch(cfg: LoadConfig, args: ServeArgs, mode: str) -> PhaseWatch:
    return PhaseWatch(cfg, mode, reset_caches=args.reset_caches,
                      scrape_metrics=args.scrape_metrics, probe_rate=args.probe_request_rate,
                      slice_seconds=args.slice_seconds, server_cpu=args.server_cpu,
                      claim=args.sessions is None, metrics_interval=args.metrics_interval)


async def _session_phase(cfg: LoadConfig, args: ServeArgs, mode: str, run_nonce: int,
                         host: MediaHost | None, cache: dict, progress: Any,
                         unmeasured: LoadConfig
                         ) -> tuple[list, float, float, list, TurnView, PhaseWatch]:
    """One phase of multi-turn sessions (load/sessions.py): its records, duration, send
    rate, each record's session's first request, its :class:`TurnView` and its watch."""
    from aphrodite_cli.bench.load.sessions import build_sessions, run_sessions

    conf = args.sessions
    firsts = make_dataset(replace(args, num_prompts=conf.conversation_num),
                          run_nonce=run_nonce)
    sessions = build_sessions(firsts, conf, seed=args.seed, nonce=run_nonce)
    if mode == "warm":  # the same sessions, sent once before measuring: unmeasured
        await run_sessions(sessions, replace(conf, num_users=None, user_centric_rate=None),
                           unmeasured, host, cache)
    task = progress.add_task(f"{mode} phase", total=sum(s.turns for s in sessions))
    async with _watch(cfg, args, mode) as watch:
        run = await run_sessions(sessions, conf, cfg, host, cache,
                                 on_done=lambda: progress.advance(task))
    return (run.records, run.duration_s, run.send_rate, run.firsts(sessions),
            TurnView(run, sessions), watch)


class TurnView:
    """A session phase's records by session and turn: the per-turn results, the first
    turns' processor cache hit rate (what a cold or warm phase claims), the rows' labels."""

    def __init__(self, run: Any, sessions: list) -> None:
        self.run, self.sessions = run, sessions

    def result(self, server_metrics: dict[str, Any] | None) -> dict[str, Any]:
        from aphrodite_cli.bench.load.turn_metrics import per_turn

        return per_turn(self.run.records, self.run.placement, len(self.sessions),
                        {s.index: s.turns for s in self.sessions}, server_metrics)

    @property
    def first_turn_hit_rate(self) -> float | None:
        hits = [bool(h) for r, (_, turn) in zip(self.run.records, self.run.placement,
                                                strict=True)
                if turn == 1 and r.ok for h in (r.server or {}).get("cache_hits") or []]
        return sum(hits) / len(hits) if hits else None

    def label(self, rows: list[dict[str, Any]]) -> None:
        """Each row's session and turn; a later turn's prompt is the history, not the
        dataset's asked length."""
        for row, (session, turn) in zip(rows, self.run.placement, strict=True):
            row["session"], row["turn"] = session, turn
            if turn > 1:
                row["input_len"] = None


def _named_settings(args: ServeArgs) -> dict[str, Any]:
    """What the result says of a public dataset by name (nothing for the others)."""
    if args.dataset not in NAMED:
        return {}
    return {"hub_dataset": {"dataset_path": str(args.dataset_path), "hf_split": args.hub.split,
                            "hf_subset": args.hub.subset, "hf_output_len": args.hub.output_len,
                            "stream": args.hub.stream}}


def _token_settings(args: ServeArgs) -> dict[str, Any] | None:
    """What the result says of prompts written in tokens (None: prompts in words)."""
    if not args.in_tokens:
        return None
    t = args.tokens
    if args.dataset in MOONCAKE:
        lengths: dict[str, Any] = {"block_tokens": t.trace_block,
                                   "seconds_per_timestamp_unit": t.trace_seconds_per_unit}
    elif args.dataset == "prefix_repetition":
        lengths = {"prefix_len": t.prefix_len, "suffix_len": t.suffix_len,
                   "num_prefixes": t.num_prefixes, "output_len": t.prefix_output_len}
    else:
        lengths = {"input_len": t.input_len, "range_ratio": t.range_ratio}
    return {**lengths, **t.prompts.describe()}


def _prompts(args: ServeArgs, cfg: LoadConfig, root: str | None) -> Any:
    """The tokenizer's prompt writer, for the target's model (``root``: where the target says
    its weights came from) and endpoint."""
    from aphrodite_cli.bench.load.token_prompts import TokenPrompts, resolve_tokenizer

    needed_by = ("--random-input-len" if args.tokens.input_len is not None
                 else f"--dataset-name {args.dataset}")
    tokenizer, name, source = resolve_tokenizer(args.tokens.tokenizer, cfg.target.model or "",
                                                needed_by, loaded=args.tokenizer, root=root)
    return TokenPrompts.build(tokenizer, chat=cfg.target.endpoint.endswith("chat/completions"),
                              name=name, source=source)


def run(cfg: LoadConfig, args: ServeArgs, target: Target, progress: Any
        ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Open the target (the embedded server, when asked, runs for the phases alone), point
    ``cfg`` at its root and model, then run the phases."""
    with target:
        cfg.target.base_url, cfg.target.model = target.root, target.model
        if args.in_tokens:
            prompts = _prompts(args, cfg, target.model_root)
            args = replace(args, tokens=replace(args.tokens, prompts=prompts))
        done = [asyncio.run(run_serve(cfg, args, progress, target.model_source))
                for _ in range(args.num_runs)]
    if len(done) == 1:
        return done[0]
    from aphrodite_cli.bench.results.runs import combine

    return combine([doc for doc, _ in done], [rows for _, rows in done])
