"""Multi-turn sessions in ``bench serve`` (AIPerf's --conversation-* and user-centric flags):
the turn counts and delays drawn, the history each later turn resends (its first message's
image, the answers the target sent), the order of a session's turns, the user-centric clock,
the per-turn results, the flags' errors, and a run against the real server whose later turns
hit its prefix cache."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from aphrodite_cli.bench.commands.serve_checks import check_session_flags
from aphrodite_cli.bench.data.datasets import random_mm
from aphrodite_cli.bench.load.client import ArrivalConfig, LoadConfig, TargetConfig
from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.load.sessions import (
    SessionConfig,
    build_sessions,
    run_sessions,
    turn_counts,
    turn_delays,
)
from aphrodite_cli.bench.load.turn_metrics import per_turn
from engine.errors import ConfigError

BIN = str(Path(sys.executable).with_name("aphrodite"))


# --- the draws --------------------------------------------------------------------------------
def test_turn_counts_are_a_rounded_normal_at_least_one_seeded_by_the_run():
    assert turn_counts(5, 3, 0, seed=1) == [3] * 5
    assert turn_counts(3, 2.5, 0, seed=1) == [3] * 3  # half up, not to even
    draws = turn_counts(4000, 5, 2, seed=7)
    assert draws == turn_counts(4000, 5, 2, seed=7) != turn_counts(4000, 5, 2, seed=8)
    assert min(draws) >= 1 and abs(sum(draws) / len(draws) - 5) < 0.15
    assert len(set(draws)) > 5  # spread, not the mean every time
    clipped = turn_counts(2000, 1, 3, seed=2)
    assert min(clipped) == 1 and clipped.count(1) > 1000  # below 1 is 1


def test_turn_delays_are_seconds_never_negative_and_leave_the_turn_counts_alone():
    counts = [3, 1, 4]
    delays = turn_delays(counts, 2000, 0, seed=3)
    assert delays == [[2.0, 2.0], [], [2.0, 2.0, 2.0]]
    spread = turn_delays([50] * 40, 100, 300, seed=3)
    flat = [d for s in spread for d in s]
    assert min(flat) == 0.0 and max(flat) > 0.3 and spread == turn_delays([50] * 40, 100, 300, 3)
    firsts = random_mm(30, items=0, buckets={(8, 8, 1): 1.0}, prompt_len=2, output_len=2,
                       seed=1, nonce=1)
    plain = build_sessions(firsts, SessionConfig(30, 4, 2), seed=9, nonce=1)
    paused = build_sessions(firsts, SessionConfig(30, 4, 2, 500, 100), seed=9, nonce=1)
    assert [s.turns for s in plain] == [s.turns for s in paused]
    assert all(len(s.delays_s) == s.turns - 1 for s in paused)
    texts = [t for s in plain for t in s.follow_ups]
    assert len(texts) == len(set(texts))  # no two later turns are the same text


# --- the flags --------------------------------------------------------------------------------
_OK = {"conversation_num": 4, "turn_mean": 3.0, "turn_stddev": 0.0, "delay_mean": 0.0,
       "delay_stddev": 0.0, "num_users": None, "user_centric_rate": None,
       "request_rate": float("inf"), "ramp_up_strategy": None, "dataset": "random-mm",
       "endpoint": "/v1/chat/completions"}


@pytest.mark.parametrize(("change", "flag"), [
    ({"conversation_num": 0}, "--conversation-num"),
    ({"turn_mean": 0.5}, "--conversation-turn-mean"),
    ({"turn_mean": float("nan")}, "--conversation-turn-mean"),
    ({"turn_stddev": -1}, "--conversation-turn-stddev"),
    ({"delay_mean": -5}, "--conversation-turn-delay-mean"),
    ({"delay_stddev": float("inf")}, "--conversation-turn-delay-stddev"),
    ({"conversation_num": None, "turn_mean": 3}, "--conversation-turn-mean"),
    ({"conversation_num": None, "turn_mean": 1.0, "num_users": 2}, "--num-users"),
    ({"num_users": 2}, "--user-centric-rate"),
    ({"user_centric_rate": 1.0}, "--num-users"),
    ({"num_users": 0, "user_centric_rate": 1.0}, "--num-users"),
    ({"num_users": 2, "user_centric_rate": 0.0}, "--user-centric-rate"),
    ({"num_users": 2, "user_centric_rate": 1.0, "request_rate": 4.0}, "--request-rate"),
    ({"num_users": 2, "user_centric_rate": 1.0, "delay_mean": 10}, "--conversation-turn-delay"),
    ({"num_users": 2, "user_centric_rate": 1.0, "turn_mean": 1}, "--conversation-turn-mean"),
    ({"endpoint": "/v1/completions"}, "--endpoint"),
    ({"dataset": "mooncake"}, "--dataset-name"),
])
def test_a_bad_session_flag_is_a_one_line_error_naming_it(change, flag):
    with pytest.raises(ConfigError) as info:
        check_session_flags(**{**_OK, **change})
    text = f"{info.value.message} {info.value.hint or ''}"
    assert flag in text and "\n" not in text and info.value.code == "invalid_flag"


def test_good_session_flags_make_the_config_and_none_without_conversation_num():
    assert check_session_flags(**{**_OK, "conversation_num": None, "turn_mean": 1.0}) is None
    conf = check_session_flags(**{**_OK, "num_users": 15, "user_centric_rate": 1.0})
    assert conf.turn_gap_s == 15.0 and conf.describe()["schedule"] == "users"


def test_the_command_line_refuses_a_bad_value_with_exit_2():
    done = subprocess.run([BIN, "bench", "serve", "--base-url", "http://127.0.0.1:9",
                           "--conversation-num", "2", "--session-turns-stddev", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--conversation-turn-stddev -1 is below 0" in done.stdout + done.stderr


# --- the wire ---------------------------------------------------------------------------------
def _capture(seen: list[dict], ttft_s: float = 0.0) -> web.Application:
    """A loopback chat target that records each request (body, arrival, end) and answers
    with text of its own per request, so a test can find each answer in the next turn."""
    counter = itertools.count()

    async def chat(request: web.Request) -> web.StreamResponse:
        entry = {"arrived": time.perf_counter(), "body": await request.json()}
        seen.append(entry)
        k = next(counter)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(ttft_s)
        entry["answer"] = f"answer {k} to you"
        for piece in (f"answer {k}", " to you"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece},
                                  "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        prompt = len(json.dumps(entry["body"]["messages"]))
        usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\n")
        entry["ended"] = time.perf_counter()
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _sessions(n: int, conf: SessionConfig, seed: int = 4):
    firsts = random_mm(n, items=1, buckets={(24, 32, 1): 1.0}, prompt_len=3, output_len=2,
                       seed=seed, nonce=11)
    return build_sessions(firsts, conf, seed=seed, nonce=11)


async def test_each_turn_resends_the_history_with_its_image_and_the_answers_in_order(
        aiohttp_server):
    """Four sessions of 3 turns, two at a time: every request of a session carries its
    first message (with the same image) unchanged, then each earlier answer exactly as the
    target sent it and the session's user texts; turn k + 1 arrives only after turn k's
    answer ended."""
    seen: list[dict] = []
    server = await aiohttp_server(_capture(seen, ttft_s=0.01))
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{server.port}", model="m"),
                     arrivals=ArrivalConfig(max_concurrency=2))
    sessions = _sessions(4, SessionConfig(4, 3))
    run = await run_sessions(sessions, SessionConfig(4, 3), cfg, None, {})
    assert len(seen) == len(run.records) == 12 and all(r.ok for r in run.records)
    by_image: dict[str, list[dict]] = {}
    for entry in seen:
        first = entry["body"]["messages"][0]
        assert first["role"] == "user" and first["content"][0]["type"] == "image_url"
        by_image.setdefault(first["content"][0]["image_url"]["url"], []).append(entry)
    assert len(by_image) == 4  # a distinct image per session, resent in each of its turns
    for entries in by_image.values():
        assert [len(e["body"]["messages"]) for e in entries] == [1, 3, 5]
        for before, after in itertools.pairwise(entries):
            assert after["arrived"] >= before["ended"]  # strictly in order
            old, new = before["body"]["messages"], after["body"]["messages"]
            assert new[: len(old)] == old  # the history grows, never rewritten
            assert new[len(old)] == {"role": "assistant", "content": before["answer"]}
            assert new[len(old) + 1]["role"] == "user"
            assert new[len(old) + 1]["content"].startswith(f"Turn {len(old) // 2 + 2} of")
    # at most two sessions in flight (--max-concurrency): the third starts as one ends
    starts = sorted(entries[0]["arrived"] for entries in by_image.values())
    ends = sorted(entries[-1]["ended"] for entries in by_image.values())
    assert starts[2] >= ends[0]
    section = per_turn(run.records, run.placement, 4, {s.index: 3 for s in sessions}, None)
    assert [t["turn"] for t in section["turns"]] == [1, 2, 3]
    assert [t["requests"] for t in section["turns"]] == [4, 4, 4]
    sizes = [t["prompt_tokens"]["mean"] for t in section["turns"]]
    assert sizes[0] < sizes[1] < sizes[2]
    assert all(t["prefix_hit_rate"] == pytest.approx(0.5, abs=0.01) for t in section["turns"])
    assert section["sessions"] == {"started": 4, "planned": 4, "completed": 4,
                                   "turns_sent": 12}


async def test_users_send_a_turn_every_num_users_over_rate_seconds(aiohttp_server):
    """2 users at 20 requests/s: each sends a turn every 0.1 s, the second 0.05 s after the
    first; with answers slower than the gap the next turn goes out as the answer ends."""
    seen: list[dict] = []
    server = await aiohttp_server(_capture(seen))
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{server.port}", model="m"))
    conf = SessionConfig(2, 3, num_users=2, user_centric_rate=20.0)
    run = await run_sessions(_sessions(2, conf), conf, cfg, None, {})
    sent = {(s, k): r.sent_at for r, (s, k) in zip(run.records, run.placement, strict=True)}
    for s in (0, 1):
        gaps = [sent[(s, k + 1)] - sent[(s, k)] for k in (1, 2)]
        assert all(0.07 <= g < 0.2 for g in gaps), gaps  # 0.1 s, less the send overhead
    assert 0.05 <= sent[(1, 1)] - run.started_at < 0.1 <= sent[(0, 2)] - run.started_at

    slow_seen: list[dict] = []
    slow = await aiohttp_server(_capture(slow_seen, ttft_s=0.2))
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{slow.port}", model="m"))
    conf = SessionConfig(1, 3, num_users=1, user_centric_rate=10.0)  # a turn every 0.1 s
    await run_sessions(_sessions(1, conf), conf, cfg, None, {})
    for before, after in itertools.pairwise(slow_seen):
        # late: at once, not a gap (0.1 s) after the answer
        assert 0 <= after["arrived"] - before["ended"] < 0.06


async def test_a_cancelled_turn_ends_its_session_and_a_refusing_target_stops_the_run(
        aiohttp_server):
    """--request-cancellation-rate 100: each session's first turn is cut, nothing follows
    it, and the turns are counted as cancelled; a target that answers 400 to all stops the
    run after --abort-after-failures answers, as single-turn runs do."""
    from aphrodite_cli.bench.load.client import TargetRefused
    from aphrodite_cli.bench.load.mock_server import create_app

    seen: list[dict] = []
    server = await aiohttp_server(_capture(seen, ttft_s=0.2))
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{server.port}", model="m"),
                     arrivals=ArrivalConfig(cancel_rate=100, cancel_delay_s=0.02))
    run = await run_sessions(_sessions(3, SessionConfig(3, 3)), SessionConfig(3, 3), cfg,
                             None, {})
    assert [k for _, k in run.placement] == [1, 1, 1] and len(seen) == 3
    assert all(r.cancelled and not r.ok for r in run.records)
    refusing = await aiohttp_server(create_app(1, 1, None, model="acme", require_model=True))
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{refusing.port}",
                                         model="other"), abort_after=3)
    with pytest.raises(TargetRefused) as info:
        await run_sessions(_sessions(6, SessionConfig(6, 2)), SessionConfig(6, 2), cfg, None,
                           {})
    assert [r.status for r in info.value.records] == [400, 400, 400]


def test_per_turn_hit_rates_come_from_each_answers_usage():
    def rec(i: int, prompt: int, cached: int, ok: bool = True) -> RequestRecord:
        r = RequestRecord(i, ok=ok, ttft=0.01 * (i + 1), e2e=0.1, output_tokens=2,
                          prompt_tokens=prompt, cached_tokens=cached)
        r.token_source = "usage"
        return r

    records = [rec(0, 100, 0), rec(1, 100, 16), rec(2, 200, 150), rec(3, 300, 0, ok=False)]
    placement = [(0, 1), (1, 1), (0, 2), (1, 2)]
    server = {"available": True, "prefix_cache": {"hit_rate": 0.4}}
    section = per_turn(records, placement, 2, {0: 2, 1: 2}, server)
    one, two = section["turns"]
    assert one["prefix_hit_rate"] == pytest.approx(16 / 200)
    assert two["prefix_hit_rate"] == pytest.approx(150 / 200)  # the failed turn left out
    assert (two["completed"], two["failed"]) == (1, 1)
    assert one["ttft_ms"]["p50"] == pytest.approx(15.0) and one["ttft_ms"]["count"] == 2
    assert section["prefix_cache_server"] == 0.4
    assert section["sessions"]["completed"] == 1


# --- against the real server ------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_later_turns_hit_the_real_servers_prefix_cache(tmp_path):
    """Two 3-turn sessions against the embedded tiny server, cold: turns 2 and 3 find their
    history (image included) in the prefix cache, turn 1 at most the chat template's start;
    the server's /metrics counted hits over the phase; the result, its rows and the report
    carry the turns."""
    done = subprocess.run([BIN, "bench", "serve", "--embedded", "--mode", "cold",
                           "--num-warmups", "0", "--conversation-num", "2",
                           "--conversation-turn-mean", "3", "--output-len", "4",
                           "--bucket-config", '{"120,160,1": 1}', "--out-dir", str(tmp_path),
                           "--result-filename", "s.json", "--jsonl"],
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    cold = doc["phases"]["cold"]
    turns = cold["per_turn"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["completed"] == 2 for t in turns)
    rates = [t["prefix_hit_rate"] for t in turns]
    assert rates[1] > rates[0] and rates[2] > rates[0] and rates[2] > 0.5, rates
    assert cold["per_turn"]["prefix_cache_server"] > rates[0]
    assert cold["cache_check"] == "ok"  # first turns: every image a processor cache miss
    assert turns[2]["prompt_tokens"]["mean"] > turns[1]["prompt_tokens"]["mean"] > \
        turns[0]["prompt_tokens"]["mean"]
    assert doc["sessions"]["conversation_num"] == 2
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert sorted((r["session"], r["turn"]) for r in rows) == [
        (s, k) for s in (0, 1) for k in (1, 2, 3)]
    assert "per turn" in done.stdout
    from aphrodite_cli.bench.results.report import write_report

    result = tmp_path / "s.json"
    write_report([result], tmp_path / "report", baseline=[result], candidate=[result])
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| 3 | 2/2 |" in summary and "**Verdict: PASS**" in summary  # A vs B reads it
