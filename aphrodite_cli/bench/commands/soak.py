"""``aphrodite bench soak``: valid, hostile and attacking traffic for a set time."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.bench.commands import flags
from aphrodite_cli.options import DecodeIsolation
from aphrodite_cli.output import err, out, print_table

#: ``aphrodite bench soak --help``'s epilog.
EXAMPLES = """Examples (SECURITY.md's 10-minute runs: a quiet baseline, then under attack):

  aphrodite bench soak --duration 120 --quiet
  aphrodite bench soak --duration 600 --hostile-share 0.25 --concurrency 4 \\
      --baseline results/soak-QUIET.json

Valid requests' media are drawn as bench serve draws them (--bucket-config); the default is
{"64,96,1": 0.5, "240,320,1": 0.25, "240,320,30": 0.25}.

Exit status 1 when a valid request got a 5xx, a hostile request or an attack got another
status than its rule's, a decode worker was replaced (no kind may cost one), memory grew more
than --max-rss-growth after warm-up, temp files were left, or valid requests' p99 latency was
over --max-p99-ratio times the baseline's."""


def soak(
    embedded: flags.Embedded = True,
    duration: Annotated[float, typer.Option(min=1, help="Seconds to run.")] = 60.0,
    hostile_share: Annotated[float, typer.Option(min=0, max=1)] = 0.25,
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    warmup: Annotated[float, typer.Option(min=0, help="Seconds before memory is judged.")
                      ] = 10.0,
    max_rss_growth: Annotated[float, typer.Option(help="Allowed RSS growth after warm-up.")
                              ] = 0.25,
    decode_isolation: Annotated[DecodeIsolation, typer.Option(help="thread or process.")
                                ] = "process",
    bucket_config: flags.BucketConfig = None,
    valid_pool: Annotated[int, typer.Option(
        min=1, help="Distinct valid requests, rendered before the run and drawn at random "
                    "(a share hit the processor cache).")] = 128,
    slow_bodies: Annotated[int, typer.Option(
        min=0, help="Connections that send a request's headers and then drip its body, "
                    "reopened as the server closes them (each must get 408).")] = 8,
    drip_flood: Annotated[int, typer.Option(
        min=0, help="Clients sending back to back requests whose media host drips (each "
                    "must get 400 media_fetch_timeout or 503 fetch_slots_busy).")] = 4,
    declared_over_cap: Annotated[int, typer.Option(
        min=0, help="Clients sending headers that declare a 1 GB body and no body, a few a "
                    "second (each must get 413 request_too_large at once).")] = 1,
    declared_unsent: Annotated[int, typer.Option(
        min=0, help="Connections declaring a body just under the body cap and sending "
                    "nothing (each must get 408; together they declare more than "
                    "--max-inflight-media-mb, and valid requests must not get 503 for it).")
    ] = 80,
    chunked_drip: Annotated[int, typer.Option(
        min=0, help="Chunked uploads streaming past the body cap (413; the in-flight "
                    "gauge must count them while they stream).")] = 2,
    slowloris: Annotated[int, typer.Option(
        min=0, help="Connections sending half a request head, a header line a second "
                    "(each must be closed at --header-read-timeout-s).")] = 4,
    connection_hog: Annotated[int, typer.Option(
        min=0, help="Clients (from --hog-address) holding --max-connections-per-client "
                    "idle connections and opening more (each extra must be admitted, the "
                    "hog's oldest idle connection closed at once in its place).")] = 1,
    attacker_address: Annotated[str, typer.Option(
        help="Local address the attacks connect from (another client to the server; any "
             "127.x.y.z is this machine on Linux); empty: the default.")] = "127.0.0.2",
    hog_address: Annotated[str, typer.Option(
        help="Local address the connection hog connects from (its own client, so the "
             "other attacks keep their connections).")] = "127.0.0.3",
    quiet: Annotated[bool, typer.Option(
        "--quiet", help="Valid traffic alone (the baseline run): --hostile-share 0 and "
                        "every attack off.")] = False,
    request_body_timeout_s: Annotated[float, typer.Option(
        min=0.5, help="The server's --request-body-timeout-s for the run (how long a slow "
                      "body holds its connection).")] = 5.0,
    header_read_timeout_s: Annotated[float, typer.Option(
        min=0.5, help="The server's --header-read-timeout-s for the run.")] = 5.0,
    max_connections_per_client: Annotated[int, typer.Option(
        min=1, help="The server's --max-connections-per-client for the run (the hog holds "
                    "this many; the attacks from --attacker-address stay under it).")] = 256,
    max_inflight_media_mb: Annotated[float, typer.Option(
        min=1, help="The server's --max-inflight-media-mb for the run (under what the "
                    "--declared-unsent sockets declare).")] = 128.0,
    baseline: Annotated[Path | None, typer.Option(
        help="A quiet run's soak result: valid requests' p99 latency is compared with its.")
    ] = None,
    max_p99_ratio: Annotated[float, typer.Option(
        min=1, help="With --baseline: most valid p99 latency may grow, e.g. 3.")] = 3.0,
    seed: flags.Seed = 0,
    out_dir: flags.OutDir = Path("results"),
    output_format: flags.OutputFormat = "table",
) -> None:
    """Valid, hostile and attacking traffic against the server for a set time; checks that
    valid requests are served, every attack is refused by its rule and nothing leaks."""
    from aphrodite_cli.bench.data.datasets import parse_buckets
    from aphrodite_cli.bench.load.attackers import Attackers, FrontDoor
    from aphrodite_cli.bench.load.hostile import (
        MAX_BODY_MB,
        SERVER_ARGS,
        SERVER_ENV,
        HostileHost,
    )
    from aphrodite_cli.bench.load.soak import failures, run_soak
    from aphrodite_cli.bench.load.target import Target
    from aphrodite_cli.bench.results.files import write_result
    from engine.errors import ConfigError, InternalError

    if not embedded:
        raise ConfigError("bench soak runs against its embedded server (it watches the "
                          "server's processes)", hint="leave --embedded on")
    if quiet:
        hostile_share = 0.0
        slow_bodies = drip_flood = declared_over_cap = declared_unsent = chunked_drip = 0
        slowloris = connection_hog = 0
    # every connection from --attacker-address at once, with a /metrics read per chunked
    # drip, twice over: an attack reconnects as soon as it is answered, and the server may
    # not have counted its last connection out yet
    from_attacker = 2 * (slow_bodies + drip_flood + declared_over_cap + declared_unsent
                         + 2 * chunked_drip + slowloris)
    if from_attacker >= max_connections_per_client:
        raise ConfigError(
            f"the attacks from --attacker-address may hold {from_attacker} connections "
            "(twice their count: closing ones not yet counted out), not under "
            f"--max-connections-per-client {max_connections_per_client}",
            hint="raise --max-connections-per-client or run fewer attackers")
    quiet_p99 = None
    if baseline is not None:
        from aphrodite_cli.bench.results.files import load_result

        quiet_p99 = (load_result(baseline, ("soak",)).get("valid_latency_s") or {}).get("p99")
        if not quiet_p99:
            raise ConfigError(f"--baseline {baseline} has no valid requests' latency",
                              hint="pass a soak result whose run had valid traffic",
                              code="result_wrong_kind")
    server_tmp = Path(tempfile.mkdtemp(prefix="aphrodite-soak-"))
    target = Target(embedded=True, server_args=[
        "--decode-isolation", decode_isolation, *SERVER_ARGS,
        # a small cache: it fills during warm-up, so growth after warm-up is a leak, not the
        # cache doing its job
        "--mm-processor-cache-gb", "0.02",
        "--request-body-timeout-s", f"{request_body_timeout_s:g}",
        "--header-read-timeout-s", f"{header_read_timeout_s:g}",
        "--max-connections-per-client", str(max_connections_per_client),
        "--max-inflight-media-mb", f"{max_inflight_media_mb:g}"],
        # a temp folder of its own: what it leaves there is the server's, not another
        # program's on the same machine
        server_env={**SERVER_ENV, "TMPDIR": str(server_tmp)})
    front_door = FrontDoor(
        declared_over_cap=declared_over_cap, declared_unsent=declared_unsent,
        chunked_drip=chunked_drip, slowloris=slowloris, connection_hog=connection_hog,
        body_cap_bytes=MAX_BODY_MB << 20,
        header_timeout_s=header_read_timeout_s, per_client=max_connections_per_client,
        hog_source=hog_address or None)
    host = HostileHost()
    try:
        with target:
            base, server = f"{target.root}/v1", target.server
            if server is None:  # the soak's Target is embedded: it always starts one
                raise InternalError("bench soak has no embedded server to watch")
            doc = run_soak(base, target.model, server.roles(),
                           duration_s=duration, hostile_share=hostile_share,
                           concurrency=concurrency, seed=seed, media_base=host.base,
                           warmup_s=min(warmup, duration / 2),
                           buckets=parse_buckets(bucket_config) if bucket_config else None,
                           valid_pool=valid_pool, attackers=Attackers(
                               base, target.model, slow_bodies=slow_bodies,
                               drip_flood=drip_flood, drip_url=f"{host.base}/drip",
                               source=attacker_address or None, front_door=front_door),
                           temp_dir=server_tmp)
    finally:
        host.close()
        shutil.rmtree(server_tmp, ignore_errors=True)
    latency = doc["valid_latency_s"]
    doc["baseline"] = None if quiet_p99 is None else {
        "path": str(baseline), "p99_s": quiet_p99,
        "p99_ratio": round(latency["p99"] / quiet_p99, 3) if latency.get("p99") else None}
    doc["failures"] = failures(doc, max_rss_growth=max_rss_growth, max_p99_ratio=max_p99_ratio)
    path = write_result(doc, "soak", out_dir)
    print_table("responses by kind of traffic", ["kind", "statuses"],
                [[kind, " ".join(f"{code}:{n}" for code, n in sorted(statuses.items()))]
                 for kind, statuses in sorted(doc["by_kind"].items())], output_format)
    say = err if output_format == "json" else out  # json: the table alone on stdout
    for miss in doc["hostile_mismatches"][:10]:
        say.print(f"  mismatch: {miss}", markup=False)
    say.print(f"requests {doc['requests']}, valid 5xx {doc['valid_5xx']}, hostile mismatches "
              f"{doc['hostile_mismatch_count']}, decode worker restarts "
              f"{doc['decode_worker_restarts']}, RSS growth after warm-up "
              f"{doc['rss_growth_after_warmup']:+.1%}, fd growth {doc['fd_growth_after_warmup']:+d}"
              f", temp leftovers {len(doc['temp_leftovers'])}", markup=False)
    say.print(f"RSS slope over the second half: {doc['rss_slope_second_half_mb_per_min']} MB/min "
              f"(by process: {doc['rss_slope_second_half_by_role_mb_per_min']}); heap in use: "
              f"{doc['heap_in_use_slope_second_half_mb_per_min']} MB/min", markup=False)
    if latency.get("count"):
        say.print(f"valid latency: p50 {latency['median']:.3f} s, p90 {latency['p90']:.3f} s, "
                  f"p99 {latency['p99']:.3f} s"
                  + (f" ({doc['baseline']['p99_ratio']}x the baseline's {quiet_p99:.3f} s)"
                     if doc["baseline"] else ""), markup=False)
    say.print("verdict: " + ("; ".join(doc["failures"]) or "clean"), markup=False)
    say.print(f"result: {path}", markup=False)
    raise typer.Exit(1 if doc["failures"] else 0)
