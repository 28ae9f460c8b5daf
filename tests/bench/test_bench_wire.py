"""What ``bench serve`` puts on the wire: ``--header`` and ``--extra-body`` on every request
(the project's mock server records what arrives), and requests the benchmark cancels itself,
their connection closed mid-stream and counted apart from failures."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aphrodite_cli.bench.data.datasets import parse_buckets, random_mm
from aphrodite_cli.bench.load import wire
from aphrodite_cli.bench.load.client import (
    ArrivalConfig,
    LoadConfig,
    TargetConfig,
    build_payload,
    run_phase,
)
from aphrodite_cli.bench.load.metrics import compute
from aphrodite_cli.bench.load.mock_server import create_app
from engine.errors import ConfigError


@pytest.mark.parametrize(("items", "api_key", "says"), [
    (["X-Tenant"], None, "is not KEY=VALUE"),
    (["=v"], None, "is not KEY=VALUE"),
    (["X Tenant=a"], None, "may not"),
    (["X-Tenant=a\r\nX-Evil: 1"], None, "CR, LF"),
    (["X-Tenant=a\nb"], None, "CR, LF"),
    (["X-Tenant=a\x00"], None, "control character"),
    (["content-type=text/plain"], None, "set by bench serve itself"),
    (["Host=evil"], None, "set by the HTTP client"),
    (["Authorization=Bearer x"], "k", "--api-key"),
    (["X-A=1", "x-a=2"], None, "given twice"),
])
def test_a_bad_header_is_a_one_line_error_naming_the_flag(items, api_key, says):
    with pytest.raises(ConfigError) as info:
        wire.parse_headers(items, api_key)
    message = info.value.message
    assert says in message and message.startswith("--header") and "\n" not in message
    assert info.value.code == "invalid_flag"


def test_headers_keep_their_values_and_authorization_works_without_an_api_key():
    assert wire.parse_headers(["X-Tenant=team=a ", "Authorization=Bearer gw"]) == {
        "X-Tenant": "team=a", "Authorization": "Bearer gw"}


@pytest.mark.parametrize(("text", "says"), [
    ("{bad", "--extra-body is not JSON (Expecting property name"),
    ("[1, 2]", "--extra-body is a JSON list, not an object"),
    ('"x"', "a JSON str, not an object"),
    ("[" * 100_000 + "]" * 100_000, "--extra-body is not JSON"),
    ('{"max_tokens": 9}', "--extra-body sets 'max_tokens', which --output-len sets"),
    ('{"temperature": 0.7}', "which --temperature sets"),
    ('{"stream": false}', "which bench serve itself (it times a stream) sets"),
    ('{"model": "x"}', "which --model sets"),
])
def test_a_bad_extra_body_is_a_one_line_error_naming_both(text, says):
    with pytest.raises(ConfigError) as info:
        wire.parse_extra_body(text)
    assert says in info.value.message and "\n" not in info.value.message


def test_cancelled_requests_are_an_exact_share_drawn_with_the_seed():
    cut = wire.cancelled_indices(40, 25, seed=3)
    assert len(cut) == 10 and cut == wire.cancelled_indices(40, 25, seed=3)
    assert cut != wire.cancelled_indices(40, 25, seed=4)
    assert wire.cancelled_indices(40, 0, 3) == frozenset()
    assert wire.cancelled_indices(5, 100, 3) == frozenset(range(5))


async def test_headers_and_extra_body_reach_the_target_and_cancelled_requests_hang_up(
        aiohttp_server):
    """Every request carries the headers and the extra body's fields beside the bench's own;
    a quarter of them are cut 60 ms after sending, mid-stream (20 tokens 10 ms apart from
    TTFT 20 ms): the mock sees those connections close before their last token, and the
    result counts them as cancelled, not failed, with no latency sample."""
    seen: list[dict] = []
    server = await aiohttp_server(create_app(20, 10, None, seen=seen))
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "cache_salt": "s1"}
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{server.port}", model="mock",
                                         headers={"X-Tenant": "team-a"}, extra_body=extra,
                                         api_key="k"),
                     arrivals=ArrivalConfig(cancel_rate=25, cancel_delay_s=0.06), seed=5)
    reqs = random_mm(12, items=0, buckets=parse_buckets(None), prompt_len=4, output_len=20,
                     seed=1, nonce=1)
    records, duration, _ = await run_phase([build_payload(r, cfg, None, {}) for r in reqs], cfg)
    await asyncio.sleep(0.1)  # the mock's next write after a hang-up notices it
    assert len(seen) == 12
    for entry in seen:
        assert entry["headers"]["X-Tenant"] == "team-a"
        assert entry["headers"]["Authorization"] == "Bearer k"
        assert entry["body"]["chat_template_kwargs"] == {"enable_thinking": False}
        assert entry["body"]["cache_salt"] == "s1" and entry["body"]["max_tokens"] == 20
    cut = wire.cancelled_indices(12, 25, 5)
    assert {r.index for r in records if r.cancelled} == cut and len(cut) == 3
    hung_up = [e for e in seen if e["disconnected"]]
    assert len(hung_up) == 3 and all(e["tokens"] < 20 for e in hung_up)
    assert all(e["tokens"] == 20 for e in seen if not e["disconnected"])
    result = compute(records, duration)
    assert (result["completed"], result["failed"], result["cancelled"]) == (9, 0, 3)
    assert result["failures_by_type"] == {} and len(result["e2e_ms"]) and \
        result["e2e_ms"]["count"] == 9
    assert all("--request-cancellation-delay" in r.error_body for r in records if r.cancelled)


async def test_a_request_cancelled_before_its_answer_starts_is_cancelled_not_failed(
        aiohttp_server):
    """Delay 0 cuts the request before the target's headers (TTFT 200 ms, headers with it);
    a request whose answer ends before its delay completes."""
    server = await aiohttp_server(create_app(200, 1, None, 200))
    root = f"http://127.0.0.1:{server.port}"
    reqs = random_mm(2, items=0, buckets=parse_buckets(None), prompt_len=4, output_len=2,
                     seed=1, nonce=1)
    for delay, want in ((0.0, (0, 0, 2)), (5.0, (2, 0, 0))):
        cfg = LoadConfig(target=TargetConfig(base_url=root),
                         arrivals=ArrivalConfig(cancel_rate=100, cancel_delay_s=delay))
        records, duration, _ = await run_phase([build_payload(r, cfg, None, {})
                                                for r in reqs], cfg)
        result = compute(records, duration)
        assert (result["completed"], result["failed"], result["cancelled"]) == want


def test_the_command_sends_headers_and_extra_body_and_counts_cancellations(recording_mock,
                                                                          tmp_path):
    """vLLM's spelling (`--header a=1 b=2`) and ours (repeated), on GET /v1/models too; the
    result keeps header names only (a gateway token stays out of the file), counts the
    cancelled requests apart in the file, the table and the per-request rows."""
    port, seen = recording_mock
    exe = Path(sys.executable).with_name("aphrodite")
    done = subprocess.run(
        [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
         "--dataset-name", "random", "--num-prompts", "8", "--num-warmups", "0", "--mode",
         "cold", "--output-len", "10", "--header", "X-Tenant=team-a", "X-Route=gpu",
         "--header", "X-Token=s3cret", "--extra-body", '{"cache_salt": "run-1"}',
         "--request-cancellation-rate", "50", "--request-cancellation-delay", "0.05",
         "--out-dir", str(tmp_path), "--result-filename", "wire.json", "--jsonl"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    models = [e for e in seen if e["path"] == "/v1/models"]
    chats = [e for e in seen if e["path"] != "/v1/models"]
    assert models and models[0]["headers"]["X-Route"] == "gpu"
    assert len(chats) == 8
    for entry in chats:
        headers = entry["headers"]
        assert (headers["X-Tenant"], headers["X-Route"], headers["X-Token"]) == (
            "team-a", "gpu", "s3cret")
        assert entry["body"]["cache_salt"] == "run-1"
    doc = json.loads((tmp_path / "wire.json").read_text())
    assert "s3cret" not in (tmp_path / "wire.json").read_text()
    assert doc["config"]["headers"] == {"X-Tenant": "(set)", "X-Route": "(set)",
                                        "X-Token": "(set)"}
    cold = doc["phases"]["cold"]
    assert (cold["completed"], cold["failed"], cold["cancelled"]) == (4, 0, 4)
    rows = [json.loads(line) for line in (tmp_path / "wire.jsonl").read_text().splitlines()]
    assert sum(r["cancelled"] for r in rows) == 4
    assert "cancelled" in done.stdout  # the table's column of its own
    bad = subprocess.run(
        [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
         "--extra-body", '{"max_tokens": 3}', "--header", "X-A=1\r\nX-B: 2"],
        capture_output=True, text=True, timeout=60)
    said = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "Traceback" not in said and "--header" in said, said
    for flag, value in (("--request-cancellation-rate", "nan"),
                        ("--request-cancellation-delay", "inf")):
        bad = subprocess.run(
            [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", flag,
             value], capture_output=True, text=True, timeout=60)
        said = bad.stdout + bad.stderr
        assert bad.returncode == 2 and "Traceback" not in said and flag in said, said
