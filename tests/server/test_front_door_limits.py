"""Front door, round three, against a real `aphrodite serve` over loopback: body accounting
that cannot lock others out, text limits checked before templating, connection limits."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from engine.errors import AphroditeError, InvalidRequestError
from engine.server.api import front_door, text_limits
from engine.server.api.app import error_response
from engine.server.api.connections import ACTIVE_GRACE_S
from engine.server.api.text_limits import TextLimits

PER_CLIENT = 8
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve(
    "--max-request-body-mb", "1", "--max-inflight-media-mb", "1.2",
    "--request-body-timeout-s", "30", "--header-read-timeout-s", "2",
    "--keep-alive-timeout-s", "2", "--max-messages", "100",
    "--max-connections-per-client", str(PER_CLIENT))]


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark, tests/served.py)."""
    return served


def connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), source_address=(source, 0))
    sock.settimeout(60)
    return sock


def head(length: int | None, chunked: bool = False) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\n{size}{'Transfer-Encoding: chunked' + chr(13) + chr(10) if chunked else ''}"
            "\r\n").encode()


def response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
    length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    try:
        return status, json.loads(rest[:length] if length is not None else rest)
    except ValueError:
        return status, {}


def post(server, body: dict, path: str = "/v1/chat/completions",
         source: str = "127.0.0.1") -> tuple[int, dict]:
    raw = json.dumps(body).encode()
    sock = connect(server, source)
    try:
        sock.sendall(head(len(raw)).replace(b"/v1/chat/completions", path.encode()) + raw)
        return response(sock)
    finally:
        sock.close()


def chat(content, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def noise_png(side: int) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def gauge(server, prefix: str) -> float:
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
    raise AssertionError(f"no {prefix} on /metrics")


def inflight(server) -> float:
    return gauge(server, "aphrodite_media_bytes_in_flight ")


# -- bodies ---------------------------------------------------------------------------------
def test_a_declared_length_over_the_cap_is_413_at_once(server):
    """Not 503 (in-flight bound): the declaration alone is refused, before any charge."""
    sock = connect(server)
    try:
        sock.sendall(head(1 << 30))
        status, doc = response(sock)
        assert status == 413, doc
        assert doc["error"]["code"] == "request_too_large"
        assert "--max-request-body-mb" in doc["error"]["message"]
    finally:
        sock.close()
    assert inflight(server) == 0


def test_a_declared_but_unsent_body_holds_nothing(server):
    """A socket that declares 0.9 MB (under the cap) and sends nothing used to hold 0.9 of
    the 1.2 MB bound; now a 0.4 MB image request from someone else is served meanwhile."""
    holder = connect(server, "127.0.0.2")
    try:
        holder.sendall(head(900_000))
        image = noise_png(300)
        assert len(image) > 300_000
        status, doc = post(server, chat([{"type": "text", "text": "hi"}, {
            "type": "image_url", "image_url": {"url": image}}]))
        assert status == 200, doc
    finally:
        holder.close()


def test_a_chunked_body_is_counted_while_it_streams(server):
    sock = connect(server, "127.0.0.3")
    try:
        sock.sendall(head(None, chunked=True))
        piece = b'{"messages": [{"role": "user", "content": "' + b"a" * 600_000
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        seen = 0.0
        for _ in range(300):  # until the server has read what was sent
            seen = inflight(server)
            if seen >= 600_000:
                break
            time.sleep(0.1)
        assert seen >= 600_000
        more = b"b" * 600_000  # past the 1 MB cap while streaming: 413
        sock.sendall(f"{len(more):x}\r\n".encode() + more + b"\r\n")
        status, doc = response(sock)
        assert status == 413 and doc["error"]["code"] == "request_too_large", doc
    finally:
        sock.close()
    for _ in range(300):
        if inflight(server) == 0:
            break
        time.sleep(0.1)
    assert inflight(server) == 0


# -- text -----------------------------------------------------------------------------------
def test_too_many_messages_are_refused_before_templating(server):
    body = {"messages": [{"role": "user", "content": "a"}] * 1000, "max_tokens": 2}
    status, doc = post(server, body)
    assert status == 400 and doc["error"]["code"] == "too_many_messages", doc
    assert "--max-messages" in doc["error"]["message"]


def test_text_that_cannot_fit_is_refused_from_its_bytes(server):
    status, doc = post(server, chat("word " * 120_000))
    assert status == 400 and doc["error"]["code"] == "prompt_too_long", doc
    assert "--max-prompt-bytes" in doc["error"]["message"]
    status, doc = post(server, {"prompt": "word " * 120_000, "max_tokens": 2},
                       path="/v1/completions")
    assert status == 400 and doc["error"]["code"] == "prompt_too_long", doc
    status, doc = post(server, chat("a short prompt"))
    assert status == 200, doc


def walks(monkeypatch) -> list[str]:
    """The per-item work of the front door, recorded as it happens: the shape walk over
    every value and the byte count of every message's text."""
    seen: list[str] = []
    shape, nbytes = front_door.check_shape, text_limits._nbytes

    def check_shape(data):
        seen.append("shape")
        return shape(data)

    def count_bytes(text):
        seen.append("bytes")
        return nbytes(text)

    monkeypatch.setattr(front_door, "check_shape", check_shape)
    monkeypatch.setattr(text_limits, "_nbytes", count_bytes)
    return seen


def test_300000_messages_are_refused_from_their_count_before_any_walk(monkeypatch):
    """A 10 MB body of 300,000 messages is refused from ``len(messages)``: no message is
    walked, measured or templated first (that walk took 1.2 s on a busy machine)."""
    limits = TextLimits(max_prompt_bytes=1 << 20, max_messages=2048)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]
                       * 300_000}).encode()
    assert len(body) >= 10_000_000
    seen = walks(monkeypatch)
    with pytest.raises(AphroditeError) as caught:
        front_door.parse_body(body, lambda data: limits.check_chat(data.get("messages")))
    doc = error_response(caught.value)
    assert doc.status == 400, doc
    error = json.loads(doc.body)["error"]
    assert error["code"] == "too_many_messages" and error["param"] == "messages", error
    assert "300000 messages" in error["message"] and "--max-messages" in error["message"]
    assert seen == []
    # ... and 300,000 prompts to /v1/completions the same way
    prompts = json.dumps({"prompt": ["hello"] * 300_000}).encode()
    with pytest.raises(AphroditeError) as caught:
        front_door.parse_body(prompts, lambda data: limits.check_prompt(data["prompt"], 100))
    assert caught.value.status == 400 and caught.value.code == "too_many_prompts"
    assert caught.value.param == "prompt" and seen == []


def test_a_body_within_the_counts_is_still_walked(monkeypatch):
    """The counts come first, the shape walk still follows: a lone surrogate in a short
    chat is refused by it."""
    limits = TextLimits(max_prompt_bytes=1 << 20, max_messages=2048)
    seen = walks(monkeypatch)
    body = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
    with pytest.raises(AphroditeError) as caught:
        front_door.parse_body(body, lambda data: limits.check_chat(data.get("messages")))
    assert caught.value.code == "invalid_json" and seen == ["bytes", "shape"]


class _Tokenizer:
    def __init__(self, vocab: list[str]) -> None:
        self.vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_the_derived_byte_bound_is_what_cannot_fit():
    limits = TextLimits.derive(_Tokenizer(["a", "Ġthe", "ĠĠĠĠ"]), 100, None, None)
    assert limits.max_prompt_bytes == 100 * 8 and limits.max_messages == 100
    assert TextLimits.derive(_Tokenizer(["a"]), 100, 5, 7) == TextLimits(5, 7)


# -- connections ----------------------------------------------------------------------------
def closed_by_server(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_that_never_finish_are_cut_off(server):
    """Half a request head, then silence: closed at the header-read timeout (2 s here; the
    old code kept it for aiohttp's hour-long default)."""
    sock = connect(server, "127.0.0.4")
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_server(sock)
    finally:
        sock.close()


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = connect(server, "127.0.0.4")
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _ = response(sock)
        assert status == 200
        assert closed_by_server(sock)  # keep-alive timeout 2 s
    finally:
        sock.close()


def test_a_gateway_holding_idle_connections_is_still_served(server):
    """Behind a reverse proxy every user is one address: a gateway holding more idle
    keep-alive connections than --max-connections-per-client is served on a new one (its
    oldest idle ones are closed to make room) instead of a 503 and a broken pipe."""
    source = "127.0.0.7"
    kept = []
    try:
        for _ in range(PER_CLIENT):
            sock = connect(server, source)
            kept.append(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert response(sock)[0] == 200
        kept += [connect(server, source) for _ in range(4)]  # idle before any request
        time.sleep(ACTIVE_GRACE_S + 0.1)  # idle, not opened or used a moment ago
        status, doc = post(server, chat("hi"), source=source)
        assert status == 200, doc
        assert closed_by_server(kept[0])  # the oldest made room
    finally:
        for sock in kept:
            sock.close()


def test_one_client_cannot_hold_every_connection(server):
    """PER_CLIENT connections from one address, each busy with a request (headers sent,
    body withheld: held until the 30 s body deadline); the next from that address is a 503
    at once, while another client is served."""
    held = [connect(server, "127.0.0.5") for _ in range(PER_CLIENT)]
    try:
        for sock in held:
            sock.sendall(head(100))
        deadline = time.monotonic() + 30  # every one busy (an idle one would make room)
        while gauge(server, "vllm:num_requests_running{") < PER_CLIENT:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        extra = connect(server, "127.0.0.5")
        try:
            status, doc = response(extra)
            assert status == 503 and doc["error"]["code"] == "too_many_connections", doc
            assert "--max-connections-per-client" in doc["error"]["message"]
        finally:
            extra.close()
        status, doc = post(server, chat("hi"), source="127.0.0.6")
        assert status == 200, doc
    finally:
        for sock in held:
            sock.close()


def test_tools_and_tool_call_arguments_count_as_prompt_text():
    """Tools (descriptions, schemas) and assistant tool calls' arguments go through the chat
    template and the tokenizer like message text: they count against --max-prompt-bytes
    (they were not counted at all)."""
    limits = TextLimits(max_prompt_bytes=1000, max_messages=16)
    big_tool = [{"type": "function", "function": {"name": "f", "description": "d" * 2000}}]
    with pytest.raises(InvalidRequestError) as info:
        limits.check_chat([{"role": "user", "content": "hi"}], big_tool)
    assert info.value.param == "tools" and "--max-prompt-bytes" in info.value.hint
    call = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "1" * 2000}}]}
    with pytest.raises(InvalidRequestError) as info:
        limits.check_chat([{"role": "user", "content": "hi"}, call])
    assert info.value.param == "messages"
    limits.check_chat([{"role": "user", "content": "hi"}, {**call, "tool_calls": []}],
                      [{"type": "function", "function": {"name": "f"}}])  # small: fine
