"""The zero-delay mock (load/instant_mock.py): what it sends is what the aiohttp mock sends with
no delays, event for event, over real loopback HTTP; it keeps connections alive, answers
pipelined requests in order, and refuses what it does not parse; ``bench serve`` measures the
same against either."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from aphrodite_cli.bench.data.datasets import parse_buckets, random_mm
from aphrodite_cli.bench.load import instant_mock
from aphrodite_cli.bench.load.client import LoadConfig, TargetConfig, build_payload, run_phase
from aphrodite_cli.bench.load.metrics import compute
from aphrodite_cli.bench.load.mock_server import create_app


@pytest.fixture
async def instant():
    """An instant mock on a free loopback port: its root URL."""
    server = await instant_mock.start("127.0.0.1", 0, model="acme/vlm")
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()
    await server.wait_closed()


def _events(text: str) -> list[object]:
    """The SSE events of an answer, ids blanked (each mock names its answers its own way)."""
    out = []
    for line in text.split("\n\n"):
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            event["id"] = "-"
            out.append(event)
        elif line:
            out.append(line)
    return out


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
     "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
     "stream": True},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True,
     "stream_options": {"include_usage": True}},
    {"prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    {"prompt": "hi", "max_tokens": 2},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True},  # 16 by default
])
async def test_it_answers_what_the_aiohttp_mock_answers_with_no_delay(aiohttp_server, instant,
                                                                      body):
    reference = await aiohttp_server(create_app(0, 0, None, model="acme/vlm"))
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answers = []
    async with aiohttp.ClientSession() as session:
        for root in (f"http://127.0.0.1:{reference.port}", instant):
            async with session.post(root + endpoint, json=body) as resp:
                assert resp.status == 200
                answers.append((resp.content_type, await resp.text()))
    (ref_type, ref_text), (type_, text) = answers
    assert type_ == ref_type
    if body.get("stream"):
        assert _events(text) == _events(ref_text)
        assert text.endswith("data: [DONE]\n\n")
    else:
        ref, got = json.loads(ref_text), json.loads(text)
        ref["id"] = got["id"] = "-"
        assert got == ref


async def test_models_health_a_wrong_model_and_a_wrong_route(instant):
    async with aiohttp.ClientSession() as session:
        async with session.get(instant + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "acme/vlm"
        async with session.get(instant + "/health") as resp:
            assert resp.status == 200
        async with session.get(instant + "/v1/nothing") as resp:
            assert resp.status == 404
        async with session.get(instant + "/v1/chat/completions") as resp:
            assert resp.status == 405
        async with session.post(instant + "/v1/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400
    server = await instant_mock.start("127.0.0.1", 0, model="acme/vlm", require_model=True)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "acme/other", "stream": True}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "model_not_found"
    finally:
        server.close()
        await server.wait_closed()


async def _raw(root: str, data: bytes) -> bytes:
    """``data`` written on one connection; everything the mock sends until it closes or
    goes quiet for a moment."""
    host, port = re.match(r"http://([^:]+):(\d+)", root).groups()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    got = b""
    try:
        while piece := await asyncio.wait_for(reader.read(65536), 1.0):
            got += piece
    except TimeoutError:
        pass
    writer.close()
    return got


async def test_keep_alive_pipelining_and_bad_requests(instant):
    body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))
    # two requests in one write, the second split mid-body: both answered, in order
    got = await _raw(instant, post + post[:-5])
    assert got.count(b"HTTP/1.1 200 OK") == 1  # the second is not complete yet
    got = await _raw(instant, post + post)
    assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b"data: [DONE]") == 2
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n0\r\n\r\n")
    assert (await _raw(instant, chunked)).startswith(b"HTTP/1.1 411 ")
    assert (await _raw(instant, b"NONSENSE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    closing = post.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    assert (await _raw(instant, closing + post)).count(b"HTTP/1.1 200 OK") == 1


async def test_bench_serve_measures_the_same_against_either_mock(aiohttp_server, instant):
    reference = await aiohttp_server(create_app(0, 0, None))
    results = []
    for root in (f"http://127.0.0.1:{reference.port}", instant):
        cfg = LoadConfig(target=TargetConfig(base_url=root), seed=1)
        reqs = random_mm(40, items=0, buckets=parse_buckets(None), prompt_len=4, output_len=7,
                         seed=1, nonce=1)
        records, duration, _ = await run_phase([build_payload(r, cfg, None, {}) for r in reqs],
                                               cfg)
        results.append((records, compute(records, duration)))
    for records, result in results:
        assert result["completed"] == 40 and result["failed"] == 0
        assert result["total_output_tokens"] == 40 * 7
        assert all(r.token_source == "usage" and len(r.itl) == 6 and r.finish_reason == "length"
                   for r in records)
