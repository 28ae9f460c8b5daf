"""What ``bench serve`` watches around a phase: the target's /metrics before and after (with
the processor cache hit rate it counted checked against the phase's claim), cache resets by
vLLM's route names, probes, time slices, and the per-kind / per-modality breakdown."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from aphrodite_cli.bench.data.datasets import BenchRequest
from aphrodite_cli.bench.load import scrape
from aphrodite_cli.bench.load.archetypes import (
    archetype_dataset,
    breakdown,
    modality,
    parse_archetypes,
)
from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.results.escape import markdown_safe
from aphrodite_cli.bench.results.intervals import slices
from engine.errors import ConfigError
from tests.server_harness import ServerProcess, free_port, wait_exit

EXE = Path(sys.executable).with_name("aphrodite")

_BEFORE = """# TYPE aphrodite_processor_cache_total counter
aphrodite_processor_cache_total{result="hit"} 10.0
aphrodite_processor_cache_total{result="miss"} 4.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 100.0
# TYPE aphrodite_stage_seconds histogram
aphrodite_stage_seconds_bucket{stage="fetch",le="1.0"} 3.0
aphrodite_stage_seconds_count{stage="fetch"} 3.0
aphrodite_stage_seconds_sum{stage="fetch"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
"""


def _after(hits: float, misses: float) -> str:
    return (_BEFORE.replace("10.0", str(10 + hits)).replace("4.0", str(4 + misses))
            .replace("100.0", "160.0").replace('"fetch"} 3.0', '"fetch"} 7.0'))


def test_metrics_deltas_and_the_cache_claim_checked_per_phase():
    before = scrape.parse(_BEFORE)
    cold = scrape.phase_metrics(before, scrape.parse(_after(0, 6)), "cold")
    assert cold["available"] and cold["check"] == "ok"
    assert cold["deltas"] == {'aphrodite_processor_cache_total{result="miss"}': 6.0,
                              'aphrodite_stage_seconds_count{stage="fetch"}': 4.0,
                              "vllm:prompt_tokens_total": 60.0}  # no gauge, no bucket
    assert cold["processor_cache"]["hit_rate"] == 0.0
    warm = scrape.phase_metrics(before, scrape.parse(_after(6, 0)), "warm")
    assert warm["check"] == "ok" and warm["processor_cache"]["hits"] == 6
    # a warm phase with misses, a cold one with hits: a warning sentence, not "ok"
    bad_warm = scrape.phase_metrics(before, scrape.parse(_after(3, 3)), "warm")
    assert "50%" in bad_warm["check"] and "warm phase" in bad_warm["check"]
    bad_cold = scrape.phase_metrics(before, scrape.parse(_after(1, 5)), "cold")
    assert bad_cold["check"].startswith("the server counted") and "no hit" in bad_cold["check"]
    # no lookups at all (a text-only phase): nothing to check
    assert scrape.phase_metrics(before, before, "cold")["check"] is None
    gone = scrape.phase_metrics("GET /metrics answered HTTP 404", before, "cold")
    assert gone == {"available": False, "reason": "GET /metrics answered HTTP 404"}


def test_vllm_mm_cache_counters_are_read_when_ours_are_absent():
    text = ("# TYPE vllm:mm_cache_queries counter\nvllm:mm_cache_queries_total 5.0\n"
            "# TYPE vllm:mm_cache_hits counter\nvllm:mm_cache_hits_total 1.0\n")
    after = text.replace("5.0", "9.0").replace("1.0", "5.0")
    warm = scrape.phase_metrics(scrape.parse(text), scrape.parse(after), "warm")
    assert warm["processor_cache"]["hits"] == 4 and warm["processor_cache"]["misses"] == 0
    assert warm["check"] == "ok"


def _record(i: int, sent: float, e2e: float | None, tokens: int = 3) -> RequestRecord:
    r = RequestRecord(i, sent_at=sent)
    if e2e is not None:
        r.ok, r.ttft, r.e2e, r.output_tokens = True, e2e / 2, e2e, tokens
    else:
        r.error = "http_500"
    return r


def test_slices_count_each_request_in_the_interval_it_ended():
    records = [_record(0, 100.0, 0.5), _record(1, 100.2, 1.0), _record(2, 101.5, 0.4),
               _record(3, 102.1, None), _record(4, 100.1, 2.2)]
    out = slices(records, 1.0)
    got = [(s["start_s"], s["completed"], s["failed"]) for s in out["intervals"]]
    # ends: 0.5, 1.2, 1.9, 2.1 (failed: its send time), 2.3
    assert got == [(0.0, 1, 0), (1.0, 2, 0), (2.0, 1, 1)]
    assert out["intervals"][1]["rps"] == 2.0 and out["intervals"][2]["partial"]
    assert out["intervals"][0]["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert sum(s["completed"] for s in out["intervals"]) == 4


def test_archetypes_parse_draw_by_weight_and_break_down_per_kind_and_modality(tmp_path):
    spec = {"photo": {"weight": 3, "buckets": {"48,64,1": 1}},
            "clip": {"weight": 1, "buckets": {"48,64,4": 1}, "output_len": 2},
            "chat": {"weight": 1, "items": 0}}
    (tmp_path / "a.json").write_text(json.dumps(spec))
    kinds = parse_archetypes(str(tmp_path / "a.json"))
    assert kinds == parse_archetypes(json.dumps(spec))
    assert kinds["photo"]["weight"] == pytest.approx(0.6)
    data = archetype_dataset(200, kinds, buckets={}, prompt_len=4, output_len=8, seed=1,
                             nonce=7)
    assert data == archetype_dataset(200, kinds, buckets={}, prompt_len=4, output_len=8,
                                     seed=1, nonce=7)
    counts = {k: sum(r.kind == k for r in data) for k in kinds}
    assert 90 < counts["photo"] < 150 and counts["chat"] > 15 and counts["clip"] > 15
    by = {r.kind: (modality(r), r.output_len) for r in data}
    assert by == {"photo": ("image", 8), "clip": ("video", 2), "chat": ("text", 8)}
    records = [_record(i, 1.0, 0.1 * (1 + (r.kind == "clip"))) for i, r in enumerate(data)]
    records[0].ok, records[0].error = False, "http_500"
    out = breakdown(data, records, 10.0)
    assert set(out["by_kind"]) == set(kinds)
    assert sum(g["completed"] for g in out["by_kind"].values()) == 199
    assert sum(g["request_throughput"] for g in out["by_kind"].values()) == pytest.approx(19.9)
    assert out["by_kind"]["clip"]["e2e_ms"]["median"] == pytest.approx(200.0)
    assert out["by_modality"]["video"]["completed"] == counts["clip"]
    for bad in ('{"a": {"weight": 0}}', '{"a": {"colour": 1}}', "[1]", "{nope"):
        with pytest.raises(ConfigError):
            parse_archetypes(bad)


def test_media_tokens_come_from_the_targets_usage_else_are_unknown():
    from aphrodite_cli.bench.load.archetypes import mm_token_summary

    a, b = _record(0, 1.0, 0.1), _record(1, 1.0, 0.1)
    a.prompt_details = {"cached_tokens": 0, "image_tokens": 64}
    out = mm_token_summary([a, b], 2.0)
    assert out["requests_with_counts"] == 1 and out["per_request"]["image"]["mean"] == 64
    assert out["throughput"]["image_tokens_per_s"] == 32.0
    assert "usage.prompt_tokens_details" in out["source"] and "unknown" in out["source"]
    b.server = {"timings": {}, "cache_hits": [], "mm_tokens": {}}  # this server, text only
    assert mm_token_summary([b], 1.0)["requests_with_counts"] == 1
    assert modality(BenchRequest("", messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}, {"type": "image_url"}]}])) == "image+audio"


@pytest.fixture
def mock_port():
    """`aphrodite bench mock-server`: no /metrics and no reset routes."""
    port = free_port()
    proc = subprocess.Popen([str(EXE), "bench", "mock-server", "--port", str(port),
                             "--model", "acme/vlm", "--ttft-ms", "20", "--itl-ms", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.stdout.readline()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield port
    proc.terminate()
    assert wait_exit(proc, 30) is not None


def test_a_target_without_metrics_or_resets_is_said_and_probes_are_measured_apart(
        mock_port, tmp_path):
    done = subprocess.run(
        [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{mock_port}",
         "--model", "acme/vlm", "--num-prompts", "12", "--num-warmups", "0", "--mode",
         "cold", "--output-len", "3", "--request-rate", "40", "--probe-request-rate", "50",
         "--slice-seconds", "0.05", "--archetypes",
         '{"a": {"weight": 1, "items": 0}, "b": {"weight": 1, "items": 0, "output_len": 2}}',
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "/reset_mm_cache: absent (HTTP 404)" in done.stdout
    assert "server /metrics unavailable (GET /metrics answered HTTP 404)" in done.stdout
    assert "per kind" in done.stdout and "probes (text only, 50/s)" in done.stdout
    doc = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    cold = doc["phases"]["cold"]
    assert cold["server_metrics"] == {"available": False,
                                      "reason": "GET /metrics answered HTTP 404"}
    assert {r["status"] for r in cold["cache_reset"].values()} == {"absent"}
    assert any("cache was not emptied" in w for w in cold["warnings"])
    # probes ran alongside and are kept apart: the phase counts its 12 requests only
    probes = cold["probes"]
    assert cold["completed"] == 12 and probes["sent"] >= 1
    assert probes["completed"] == probes["sent"] and probes["failed"] == 0
    assert len(probes["samples"]["ttft_ms"]) == probes["completed"]
    assert sum(s["completed"] for s in cold["slices"]["intervals"]) == 12
    assert sum(g["completed"] for g in cold["by_kind"].values()) == 12
    assert set(cold["by_kind"]) <= {"a", "b"} and set(cold["by_modality"]) == {"text"}
    assert cold["mm_tokens"]["source"] == "unknown"
    # bench report shows every part: tables in the summary, slices and probes plotted
    report = subprocess.run([str(EXE), "bench", "report", str(next(tmp_path.glob(
        "serve-*.json"))), "--out-dir", str(tmp_path / "report")], capture_output=True,
        text=True, timeout=120)
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    summary = (tmp_path / "report" / "summary.md").read_text()
    for part in ("cold: probes", "cold: per kind", "| a |", "cold: every 0.05 s",
                 "server /metrics: unavailable",
                 # the target's own words are escaped for Markdown (issue 47)
                 markdown_safe("/reset_mm_cache: absent (HTTP 404)")):
        assert part in summary, part
    page = (tmp_path / "report" / "report.html").read_text()
    assert ": time slices" in page and ": probe TTFT" in page and "per kind" in page
    # --no-reset-caches: no reset asked for, nothing said
    done = subprocess.run(
        [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{mock_port}",
         "--model", "acme/vlm", "--num-prompts", "2", "--num-warmups", "0", "--mode", "cold",
         "--items-per-request", "0", "--no-reset-caches", "--result-filename", "b.json",
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cache_reset" not in json.loads((tmp_path / "b.json").read_text())["phases"]["cold"]


def _chat(base: str, image_url: str) -> tuple[str, list[bool]]:
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": "hi"}]}], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.headers["x-aphrodite-api-server"], json.loads(resp.read())[
            "aphrodite"]["cache_hits"]


def _cached_tokens(base: str) -> int:
    words = " ".join(f"word{i}" for i in range(120))
    body = json.dumps({"messages": [{"role": "user", "content": words}],
                       "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        usage = json.loads(resp.read())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


ADMIN_KEY = "observe-admin-key"


def _post(base: str, path: str) -> dict:
    req = urllib.request.Request(f"{base}{path}", data=b"", method="POST",
                                 headers={"Connection": "close",
                                          "Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.timeout(600)
def test_cache_resets_reach_every_api_server_and_bench_checks_the_counted_hits(tmp_path):
    """POST /reset_mm_cache empties the processor cache of both API servers (the first
    answer of each after the reset is a miss); /reset_prefix_cache answers with what was
    done. Then bench serve against the same server: before its cold phase it resets both
    caches, and /metrics' counted lookups (both API servers summed) agree with the cold claim.
    (A warm phase against two API servers is not all hits: each has its own cache and the
    warm-up pass reaches only one of them per item; the check says so as a warning.)"""
    import base64

    from tests.fixtures import synthetic

    image = "data:image/png;base64," + base64.b64encode(
        synthetic.make_image(64, 48, fmt="PNG", seed=3)).decode()
    server = ServerProcess("tiny:qwen2_vl", "--api-server-count", "2",
                           "--expose-request-timings", "--admin-api-key", ADMIN_KEY
                           ).wait_ready()
    try:
        api_pids = {str(p) for p in server.processes()["api_servers"]}
        assert len(api_pids) == 2

        def until_both_answered() -> dict[str, list[list[bool]]]:
            # one at a time (two concurrent misses of one image would both miss), each on a
            # new connection, which lands on either server with even odds: 64 tries leave
            # one unseen twice with odds of about 2**-58
            seen: dict[str, list[list[bool]]] = {}
            for _ in range(64):
                pid, hits = _chat(server.base, image)
                seen.setdefault(pid, []).append(hits)
                if set(seen) == api_pids and all(len(v) >= 2 for v in seen.values()):
                    break
            return seen

        warmed = until_both_answered()
        assert set(warmed) == api_pids
        assert all(v[-1] == [True] for v in warmed.values())  # both hold the image now
        mm = _post(server.base, "/reset_mm_cache")
        assert mm["reset"] is True and mm["api_servers"] == 2, mm
        assert mm["encoder_entries_dropped"] >= 1, mm  # the engine's encoder cache too
        # the engine's prefix cache: a long prompt's second send reuses blocks; after the
        # reset, none (the reset runs on the engine thread between two steps)
        assert _cached_tokens(server.base) >= 0
        assert _cached_tokens(server.base) > 0
        prefix = _post(server.base, "/reset_prefix_cache")
        assert prefix["reset"] is True and prefix["blocks_dropped"] > 0, prefix
        assert _cached_tokens(server.base) == 0
        time.sleep(0.5)  # the sibling's reader clears on the engine's message, not on ours
        after = until_both_answered()
        # each API server's first lookup after the reset missed: every cache was emptied
        assert all(v[0] == [False] for v in after.values()), after
        done = subprocess.run(
            [str(EXE), "bench", "serve", "--base-url", server.base, "--num-prompts", "4",
             "--admin-api-key", ADMIN_KEY,  # (the resets take it, not the API's key)
             "--num-warmups", "0", "--mode", "cold", "--bucket-config", '{"48,64,1": 1}',
             "--output-len", "2", "--out-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        doc = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
        cold = doc["phases"]["cold"]
        assert cold["cache_reset"]["/reset_mm_cache"]["status"] == "reset"
        assert doc["config"]["admin_api_key"] == "(set)"  # (the key itself is not written)
        assert cold["server_metrics"]["processor_cache"]["misses"] == 4
        assert cold["server_metrics"]["processor_cache"]["hits"] == 0
        assert cold["server_metrics"]["check"] == "ok"
        # the server's media tokens per request (the tiny model: a 64x48 image is a few)
        tokens = cold["mm_tokens"]
        assert tokens["source"] == "aphrodite.mm_tokens" and tokens["requests_with_counts"] == 4
        assert tokens["per_request"]["image"]["min"] > 0
        assert tokens["throughput"]["image_tokens_per_s"] > 0
        assert cold["server_metrics"]["deltas"][
            'aphrodite_requests_total{route="/v1/chat/completions",status="200"}'] == 4
        assert "processor cache 0 hits, 4 misses (ok)" in done.stdout
        # the server's CPU over the phase, process by process: the supervisor found above
        # the API servers that listen, so its engine (their sibling) counts too
        cpu = cold["server_cpu"]
        names = [p["name"] for p in cpu["processes"]]
        assert cpu["status"] == "ok" and names.count("aphrodite-api") == 2, cpu
        assert {"aphrodite", "aphrodite-eng"} <= set(names), cpu
        engine = next(p for p in cpu["processes"] if p["name"] == "aphrodite-eng")
        assert engine["cpu_s"] > 0 and cpu["cpu_ms_per_request"] == pytest.approx(
            cpu["cpu_s"] / 4 * 1e3, abs=0.1)
        assert "cold: server CPU:" in done.stdout and "aphrodite-eng" in done.stdout
    finally:
        server.stop()


def test_t_interval_and_runs_combined_into_one_result():
    from aphrodite_cli.bench.results.runs import combine
    from aphrodite_cli.bench.results.stats import t_interval

    ci = t_interval([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["high"] - 2.0 == pytest.approx(4.303 / 3 ** 0.5)
    assert t_interval([5.0]) | {"method": None} == {"n": 1, "mean": 5.0, "low": 5.0,
                                                    "high": 5.0, "method": None}

    def doc(ttft: float) -> dict:
        return {"phases": {"cold": {"request_throughput": 10.0, "ttft_ms": {"median": ttft},
                                    "samples": {"ttft_ms": [ttft, ttft],
                                                "stages_ms": {"fetch_s": [1.0]}}}}}

    out, rows = combine([doc(10.0), doc(20.0), doc(30.0)],
                        [{"cold": [{"index": 0}]}, {"cold": [{"index": 0}]},
                         {"cold": [{"index": 0}]}])
    cold = out["phases"]["cold"]
    assert out["num_runs"] == 3 and [r["ttft_ms_p50"] for r in cold["runs"]] == [10, 20, 30]
    assert cold["ci95"]["ttft_ms_p50"]["mean"] == 20.0
    assert cold["ci95"]["ttft_ms_p50"]["low"] < 10.0 < 30.0 < cold["ci95"]["ttft_ms_p50"]["high"]
    assert cold["ci95"]["request_throughput"]["low"] == 10.0  # no spread
    assert cold["ci95"]["tpot_ms_p50"]["n"] == 0  # not measured: no interval
    assert cold["samples"] == {"ttft_ms": [10.0] * 2 + [20.0] * 2 + [30.0] * 2,
                               "stages_ms": {"fetch_s": [1.0, 1.0, 1.0]}}
    assert [r["run"] for r in rows["cold"]] == [1, 2, 3]
    assert "per_run" not in cold  # nothing per run to keep


def test_each_runs_turn_table_and_telemetry_are_kept_and_reported(tmp_path):
    """--num-runs: a per-turn table and a telemetry series have no pooled form, so every
    run's is kept (``per_run``) and the report draws each, not the first run's alone."""
    from aphrodite_cli.bench.results.report_serve_extras import serve_markdown
    from aphrodite_cli.bench.results.runs import combine

    def doc(ttft: float, queue: float) -> dict:
        turn = {"turn": 1, "requests": 2, "completed": 2, "failed": 0, "cancelled": 0,
                "ttft_ms": {"count": 2, "p50": ttft, "p90": ttft, "mean": ttft},
                "prompt_tokens": {"mean": 10, "total": 20},
                "output_tokens": {"mean": 3, "total": 6}, "cached_tokens": 0,
                "prefix_hit_rate": 0.0}
        return {"phases": {"cold": {
            "request_throughput": 1.0, "ttft_ms": {"median": ttft},
            "per_turn": {"turns": [turn], "prefix_cache_server": None,
                         "sessions": {"started": 2, "planned": 2, "completed": 2,
                                      "turns_sent": 2}},
            "telemetry": {"interval_s": 0.5, "metrics": {
                "available": True, "samples": [{"t_s": 0.0, "num_requests_waiting": queue}]}}}}}

    out, _ = combine([doc(11.0, 4.0), doc(22.0, 7.0)], [{}, {}])
    cold = out["phases"]["cold"]
    assert [p["per_turn"]["turns"][0]["ttft_ms"]["p50"] for p in cold["per_run"]] == [11, 22]
    assert [p["telemetry"]["metrics"]["samples"][0]["num_requests_waiting"]
            for p in cold["per_run"]] == [4.0, 7.0]
    text = "\n".join(serve_markdown({"phases": {"cold": cold}}))
    assert "cold run 1 of 2: per turn" in text and "cold run 2 of 2: per turn" in text
    assert "cold run 2 of 2: telemetry" in text


def test_num_runs_gives_intervals_that_gate_and_report_use(mock_port, tmp_path):
    def bench(name: str, *extra: str) -> Path:
        done = subprocess.run(
            [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{mock_port}",
             "--model", "acme/vlm", "--num-prompts", "6", "--num-warmups", "0", "--mode",
             "cold", "--items-per-request", "0", "--output-len", "3", "--num-runs", "3",
             "--no-reset-caches", "--jsonl", "--result-filename", name, "--out-dir",
             str(tmp_path), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "cold: over 3 runs" in done.stdout and "ttft_ms_p50" in done.stdout
        return tmp_path / name

    a = bench("a.json")
    doc = json.loads(a.read_text())
    cold = doc["phases"]["cold"]
    assert doc["num_runs"] == 3 and len(cold["runs"]) == 3
    assert len(cold["samples"]["ttft_ms"]) == 18  # the gate pools every run's requests
    ci = cold["ci95"]["ttft_ms_p50"]
    assert ci["n"] == 3 and ci["low"] <= ci["mean"] <= ci["high"]
    assert "t-interval" in ci["method"]
    rows = [json.loads(line) for line in a.with_suffix(".jsonl").read_text().splitlines()]
    assert sorted({r["run"] for r in rows}) == [1, 2, 3] and len(rows) == 18
    # a candidate whose every run's TTFT interval lies far above the baseline's: the
    # run-level check fails the gate (made by hand: no test waits on a slow server)
    b = tmp_path / "b.json"
    slow = json.loads(a.read_text())
    for run in slow["phases"]["cold"]["runs"]:
        run["ttft_ms_p50"] = ci["high"] * 10 + 100
    from aphrodite_cli.bench.results.stats import t_interval

    slow["phases"]["cold"]["ci95"]["ttft_ms_p50"] = t_interval(
        [r["ttft_ms_p50"] + i for i, r in enumerate(slow["phases"]["cold"]["runs"])])
    b.write_text(json.dumps(slow))
    gate = subprocess.run([str(EXE), "bench", "gate", "--baseline", str(a), "--candidate",
                           str(b)], capture_output=True, text=True, timeout=120)
    assert gate.returncode == 1, gate.stdout
    assert re.search(r"\| cold \| ttft_ms_p50 \| .* \| \*\*regression\*\*", gate.stdout)
    same = subprocess.run([str(EXE), "bench", "gate", "--baseline", str(a), "--candidate",
                           str(a)], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "run-level metric" in same.stdout, same.stdout
    report = subprocess.run([str(EXE), "bench", "report", "--baseline", str(a),
                             "--candidate", str(b), "--out-dir", str(tmp_path / "r")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "cold: over 3 runs" in summary and "run-level metric" in summary


def test_trace_lines_parse_in_arrival_order_with_their_media(tmp_path):
    from aphrodite_cli.bench.load.trace import load_trace

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.jpg").write_bytes(b"\xff\xd8jpeg")
    lines = [{"timestamp": 2500, "text": "late", "output_length": 3, "kind": "k2"},
             {"arrival_s": 1.0, "prompt": "first", "output_len": 2,
              "media": [{"type": "image", "width": 64, "height": 48}]},
             {"arrival_s": 1.5, "prompt": "by url", "media": [
                 {"type": "image", "url": "http://media.example/x.jpg"},
                 {"type": "image", "path": "a.jpg"}]}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_trace(trace, tmp_path / "m", limit=10, nonce=5)
    assert [(r.prompt, r.arrival_s, r.output_len) for r in reqs] == [
        ("first", 0.0, 2), ("by url", 0.5, 16), ("late", 1.5, 3)]
    assert reqs[0].media[0].kind == "image" and reqs[0].media[0].width == 64
    parts = reqs[1].messages[0]["content"]
    assert parts[0]["image_url"]["url"] == "http://media.example/x.jpg"
    assert parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert parts[2] == {"type": "text", "text": "by url"} and reqs[2].kind == "k2"
    assert len(load_trace(trace, tmp_path / "m", limit=2, nonce=5)) == 2
    for bad in ({"prompt": "no time"}, {"arrival_s": 1, "media": [{"type": "pdf"}]},
                {"arrival_s": -1}):
        trace.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ConfigError):
            load_trace(trace, None, limit=10, nonce=5)


def test_a_trace_is_replayed_at_its_arrival_times(mock_port, tmp_path):
    trace = tmp_path / "t.jsonl"
    arrivals = [0.0, 0.4, 0.2, 0.8]  # out of order in the file: replayed by arrival
    trace.write_text("".join(json.dumps({"arrival_s": 10 + a, "prompt": f"p{a}",
                                         "output_len": 2, "kind": "early" if a < 0.3
                                         else "late"}) + "\n" for a in arrivals))
    done = subprocess.run(
        [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{mock_port}",
         "--model", "acme/vlm", "--dataset-name", "trace", "--dataset-path", str(trace),
         "--num-warmups", "0", "--mode", "cold", "--no-reset-caches", "--result-filename",
         "t.json", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "t.json").read_text())
    rows = doc["requests"]["cold"]
    assert len(rows) == 4 and doc["phases"]["cold"]["completed"] == 4
    # never sent before its time (later is the machine's business, not asserted)
    for row, due in zip(rows, sorted(arrivals), strict=True):
        assert row["sent_ms"] >= due * 1000 - 1, (row, due)
    assert doc["phases"]["cold"]["by_kind"]["early"]["completed"] == 2
