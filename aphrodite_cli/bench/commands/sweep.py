"""``aphrodite bench sweep``: latency against load, and the capacity at SLOs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.bench.commands import flags
from aphrodite_cli.options import SweepProfile
from aphrodite_cli.output import err, out, print_table

#: ``aphrodite bench sweep --help``'s epilog.
EXAMPLES = """Examples:

  aphrodite bench sweep --embedded --mode both --slo ttft:p99:300 --slo e2el:p90:2000

  aphrodite bench sweep --base-url http://gpu-box:8000 --rates 1,2,4,8 --items-per-request 1

  aphrodite bench sweep --base-url http://gpu-box:8000 --profile sweep --num-points 6

Each point is a bench serve measurement; the result holds every point, the curve and, with
--slo, the capacity per phase (the highest rate meeting every SLO).

  aphrodite bench sweep serve --serve-params '[{"max_num_seqs": 4}, {"max_num_seqs": 16}]'

sweeps server flags instead: see aphrodite bench sweep serve --help."""


def sweep_cmd(
    ctx: typer.Context,
    base_url: flags.BaseUrl = None,
    host: flags.Host = None,
    port: flags.Port = None,
    endpoint: flags.Endpoint = None,
    embedded: flags.Embedded = False,
    server_engine: flags.EmbeddedEngine = "aphrodite",
    model: flags.Model = None,
    api_key: flags.ApiKey = None,
    mode: flags.Mode = "cold",
    rates: Annotated[str | None, typer.Option(help="Request rates to measure, e.g. 1,2,4,8.")
                     ] = None,
    concurrencies: Annotated[str | None, typer.Option(
        help="Concurrencies to measure (closed loop), e.g. 1,4,16.")] = None,
    profile: Annotated[SweepProfile | None, typer.Option(
        help="sweep: one at a time, all at once, then --num-points rates between (with "
             "--slo, then the capacity search too).")] = None,
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
    num_warmups: flags.NumWarmups = 2,
    burstiness: flags.Burstiness = 1.0,
    num_prompts: Annotated[int, typer.Option(
        min=1, help="Requests in the warm phase's pool (sent once before its points).")] = 50,
    items_per_request: flags.ItemsPerRequest = 1,
    bucket_config: flags.BucketConfig = None,
    prompt_len: flags.PromptLen = 32,
    output_len: flags.OutputLen = 16,
    media_delivery: flags.MediaDelivery = "data-url",
    max_failure_rate: flags.MaxFailureRate = 0.0,
    seed: flags.Seed = 0,
    out_dir: flags.OutDir = Path("results"),
    output_format: flags.OutputFormat = "table",
    request_timeout: flags.RequestTimeout = 300.0,
    max_response_mb: flags.MaxResponseMb = 16.0,
    ttft_from: flags.TtftFrom = "content",
) -> None:
    """Latency against load, and the capacity at an SLO, cold media and warm cache.
    `bench sweep serve` sweeps server flags instead (see its --help)."""
    if ctx.invoked_subcommand is not None:  # `bench sweep serve ...`: its own flags
        return
    from aphrodite_cli.bench.data.datasets import parse_buckets, random_mm
    from aphrodite_cli.bench.load import sweep as sw
    from aphrodite_cli.bench.load.client import (
        CHAT_ENDPOINT,
        ArrivalConfig,
        LoadConfig,
        MediaConfig,
        TargetConfig,
        TargetRefused,
    )
    from aphrodite_cli.bench.load.target import Target
    from aphrodite_cli.bench.results.escape import printable
    from aphrodite_cli.bench.results.files import write_result
    from engine.errors import BenchmarkFailed, ConfigError

    target = Target(base_url, host=host, port=port, embedded=embedded, model=model,
                    engine=server_engine, api_key=api_key)
    try:
        rate_list = [float(r) for r in (rates or "").split(",") if r.strip()]
        conc_list = [int(c) for c in (concurrencies or "").split(",") if c.strip()]
    except ValueError:
        raise ConfigError("--rates and --concurrencies are comma-separated numbers",
                          code="invalid_flag") from None
    slos = [sw.Slo.parse(s) for s in slo or []]
    if (rate_list or conc_list) and (profile or slos):
        raise ConfigError("--rates/--concurrencies measure the given points only: drop them "
                          "for --profile sweep or --slo (which go together: the profile's "
                          "points, then the capacity search)", code="invalid_flag")
    buckets = parse_buckets(bucket_config)
    settings = sw.SweepSettings(duration_s=duration_s, min_requests=min_requests,
                                num_warmups=num_warmups, num_points=num_points,
                                rate_precision=rate_precision)

    def make(n: int, run_nonce: int) -> list:
        return random_mm(n, items=items_per_request, buckets=buckets, prompt_len=prompt_len,
                         output_len=output_len, seed=seed, nonce=run_nonce)

    say = err if output_format == "json" else out  # json: the table alone on stdout

    def on_point(phase: str, point: dict) -> None:
        what = (f"rate {point['offered_rate']:.3g}/s" if point["offered_rate"] else
                f"concurrency {point['concurrency']}" if point["concurrency"] else
                "all at once")
        served = point["served_rate"]
        e2e = point["result"]["e2e_ms"].get("p90")
        verdict = "" if not slos else (" meets the SLOs" if point["met"] else " misses")
        say.print(f"  {phase} {point['kind']:<12} {what:<18} served "
                  f"{served or 0:.3g}/s, e2e p90 {e2e or 0:.1f} ms{verdict}", markup=False)

    with target:
        root, name = target.root, target.model
        cfg = LoadConfig(
            target=TargetConfig(base_url=root,
                                endpoint="/" + (endpoint or CHAT_ENDPOINT).lstrip("/"),
                                model=name, api_key=api_key),
            arrivals=ArrivalConfig(burstiness=burstiness),
            media=MediaConfig(media_delivery=media_delivery), seed=seed,
            timeout_s=request_timeout, max_response_bytes=int(max_response_mb * (1 << 20)),
            ttft_from=ttft_from)
        modes = ("cold", "warm") if mode == "both" else (mode,)
        try:
            doc = sw.run(cfg, make, modes=modes, settings=settings, slos=slos,
                         rates=rate_list, concurrencies=conc_list, pool_size=num_prompts,
                         seed=seed, media_delivery=media_delivery,
                         profile=profile == "sweep", on_point=on_point)
        except TargetRefused as refused:
            first = refused.records[0]
            raise BenchmarkFailed(
                f"the first {len(refused.records)} requests to {refused.url} all got HTTP "
                f"{first.status} ({first.error}); the sweep was stopped. The target said: "
                f"{(first.error_body or '').strip()[:300]}",
                hint="check --base-url/--endpoint, --model and --api-key") from None
    doc = {"kind": "sweep",
           "target": {"base_url": root, "endpoint": cfg.target.endpoint, "model": printable(name),
                      "embedded": embedded},
           "slos": [s.label for s in slos], "keep_up_share": sw.KEEP_UP,
           "settings": settings.__dict__, "burstiness": burstiness,
           "dataset": {"items_per_request": items_per_request, "prompt_len": prompt_len,
                       "output_len": output_len, "buckets": {",".join(map(str, k)): v
                                                             for k, v in buckets.items()}},
           "noise": "an SLO is met only when the upper end of its percentile's 95% bootstrap "
                    "interval is within the limit: the capacity is conservative", **doc}
    path = write_result(doc, "sweep", out_dir)

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    print_table(f"{printable(name)}: every point",
                ["phase", "kind", "offered", "scheduled/s", "sent/s", "served/s",
                 "TTFT p50 ms", "TTFT p90 ms", "E2E p90 ms", "failed", "meets SLOs"],
                [[phase, p["kind"], f"{p['offered_rate']:.3g}/s" if p["offered_rate"] else
                  f"concurrency {p['concurrency']}" if p["concurrency"] else "all at once",
                  rate(p.get("scheduled_rate")), rate(p.get("sent_rate")),
                  f"{p['served_rate'] or 0:.3g}",
                  *(f"{p['result'][m].get(q, 0) or 0:.1f}" for m, q in (
                      ("ttft_ms", "median"), ("ttft_ms", "p90"), ("e2e_ms", "p90"))),
                  f"{p['result']['failed']}/{p['requests']}",
                  "" if not slos else ("yes" if p["met"] else "no")]
                 for phase, result in doc["phases"].items() for p in result["points"]],
                output_format)
    for phase, result in doc["phases"].items():
        cap = result["capacity"]
        if cap is not None:
            value = f"{cap['rate']:.3g} requests/s" if cap["rate"] else "none"
            where = (f", sustained at the point offered {cap['offered_rate']:.3g}/s "
                     f"(scheduled {rate(cap['scheduled_rate'])}, sent {rate(cap['sent_rate'])}"
                     f", served {rate(cap['served_rate'])})" if cap.get("offered_rate") else "")
            say.print(f"{phase} capacity: {value}{where} (limited by {cap['limited_by']}: "
                      f"{cap['why']}); {len(result['points'])} points in "
                      f"{result['seconds']:.0f} s", markup=False)
    say.print(f"result: {path}", markup=False)
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
