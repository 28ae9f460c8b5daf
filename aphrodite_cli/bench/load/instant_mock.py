"""A zero-delay mock OpenAI-compatible endpoint that costs its host next to nothing per request,
so a load generator measured against it measures itself: every answer is built once per shape
(endpoint, tokens, streamed, with usage) and written in one piece.

It answers as :func:`aphrodite_cli.bench.load.mock_server.create_app` does with no delays (the
same SSE events: a role chunk on the chat endpoint, one chunk per token, the usage chunk when
asked for, ``data: [DONE]``; each event one HTTP chunk), over a small HTTP/1.1 parser on an
asyncio protocol instead of aiohttp's server: the aiohttp mock spent about 0.4 ms of CPU per
16-token answer, as much as the client it was measuring. Keep-alive, pipelining and
``Content-Length`` bodies are served; a chunked request body is a 411, a malformed request a
400 and the connection closed. ``aphrodite bench mock-server`` runs it when every delay is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

#: The longest request head (request line and headers) read before a 431.
MAX_HEAD_BYTES = 64 << 10
#: The largest request body accepted (the aiohttp mock's ``client_max_size``).
MAX_BODY_BYTES = 1 << 30
#: Answers kept built, by shape; past this the oldest shapes are built again when asked.
MAX_SHAPES = 4096

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            411: "Length Required", 413: "Payload Too Large",
            431: "Request Header Fields Too Large"}
_ID = "mock-instant"


def _event(obj: dict) -> bytes:
    """One SSE event as one HTTP chunk (the aiohttp mock's ``json.dumps`` spacing)."""
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_body(n: int, chat_api: bool, usage: bool) -> bytes:
    """The chunked body of a streamed answer of ``n`` tokens, its last chunk included."""
    parts = []
    if chat_api:
        parts.append(_event({"id": _ID, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""},
             "finish_reason": None}]}))
    for i in range(n):
        choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None,
                  **({"delta": {"content": " tok"}} if chat_api else {"text": " tok"})}
        parts.append(_event({"id": _ID, "object": "chat.completion.chunk",
                             "choices": [choice]}))
    if usage:
        parts.append(_event({"id": _ID, "object": "chat.completion.chunk", "choices": [],
                             "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                       "total_tokens": n + 1}}))
    parts.append(b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"))
    return b"".join(parts) + b"0\r\n\r\n"


def _response(status: int, body: bytes, content_type: str = "application/json",
              close: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "")
            + "\r\n").encode()
    return head + body


def _json(status: int, obj: dict, close: bool = False) -> bytes:
    return _response(status, json.dumps(obj).encode(), close=close)


class _Answers:
    """The server's settings and its answers built so far."""

    def __init__(self, model: str, output_tokens: int | None, usage: bool,
                 require_model: bool) -> None:
        self.model, self.output_tokens, self.usage = model, output_tokens, usage
        self.require_model = require_model
        self.built: dict[tuple[bool, int, bool, bool], bytes] = {}
        self.models = _json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        self.health = _json(200, {"status": "ok"})

    def completion(self, path: str, raw: bytes) -> bytes:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return _json(400, {"error": {"message": "the body is not a JSON object",
                                         "type": "invalid_request_error"}})
        if self.require_model and body.get("model") != self.model:
            return _json(400, {"error": {
                "message": f"The model `{body.get('model')}` does not exist; this server "
                           f"serves `{self.model}`.", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}})
        try:
            n = int(self.output_tokens or body.get("max_tokens")
                    or body.get("max_completion_tokens") or 16)
        except (TypeError, ValueError):
            n = 16
        n = max(0, min(n, 1 << 20))
        options = body.get("stream_options")
        with_usage = bool(self.usage and isinstance(options, dict)
                          and options.get("include_usage"))
        key = (path.endswith("chat/completions"), n, bool(body.get("stream")), with_usage)
        answer = self.built.get(key)
        if answer is None:
            answer = self._build(*key)
            if len(self.built) >= MAX_SHAPES:
                self.built.pop(next(iter(self.built)))
            self.built[key] = answer
        return answer

    def _build(self, chat_api: bool, n: int, stream: bool, usage: bool) -> bytes:
        if stream:
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" + stream_body(n, chat_api, usage))
        text = " tok" * n
        choice = ({"message": {"role": "assistant", "content": text}} if chat_api
                  else {"text": text})
        return _json(200, {"id": _ID, "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "length", **choice}],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed from the bytes as they come, in order."""

    def __init__(self, answers: _Answers) -> None:
        self.answers, self.buffer, self.transport = answers, bytearray(), None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing():
            if not self._one():
                return

    def _fail(self, status: int, message: str) -> None:
        self.transport.write(_json(status, {"error": {"message": message,
                                                      "type": "invalid_request_error"}},
                                   close=True))
        self.transport.close()

    def _one(self) -> bool:
        """Answer the first complete request in the buffer; False when none is complete."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                self._fail(431, "the request head is too long")
            return False
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._fail(400, "not an HTTP/1.x request line")
            return False
        method, target, version = parts
        length, close = 0, version == b"HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                if not value.isdigit() or int(value) > MAX_BODY_BYTES:
                    self._fail(413 if value.isdigit() else 400, "bad Content-Length")
                    return False
                length = int(value)
            elif name == b"transfer-encoding":
                self._fail(411, "send the body with a Content-Length")
                return False
            elif name == b"connection":
                lowered = value.lower()
                close = lowered == b"close" or (close and lowered != b"keep-alive")
        if len(self.buffer) < end + 4 + length:
            return False  # the body is still coming
        raw = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        path = target.split(b"?", 1)[0].decode("latin-1")
        self.transport.write(self._route(method, path, raw))
        if close:
            self.transport.close()
            return False
        return True

    def _route(self, method: bytes, path: str, raw: bytes) -> bytes:
        answers = self.answers
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != b"POST":
                return _json(405, {"error": {"message": "use POST"}})
            return answers.completion(path, raw)
        if path == "/v1/models" and method == b"GET":
            return answers.models
        if path == "/health" and method == b"GET":
            return answers.health
        return _json(404, {"error": {"message": f"no route {path}"}})


async def start(host: str, port: int, *, model: str = "mock",
                output_tokens: int | None = None, usage: bool = True,
                require_model: bool = False, reuse_port: bool = False) -> asyncio.Server:
    """Listen on ``host``:``port`` (0: any free port; ``server.sockets[0]`` says which).
    ``reuse_port``: several processes share the port (SO_REUSEPORT; the kernel spreads
    connections among them)."""
    answers = _Answers(model, output_tokens, usage, require_model)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return await asyncio.get_running_loop().create_server(lambda: _Connection(answers),
                                                          sock=sock, backlog=1024)


def run(host: str, port: int, **options: object) -> None:
    """Serve in this process until interrupted (Ctrl-C; SIGTERM ends it by default)."""

    async def forever() -> None:
        async with await start(host, port, **options) as server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(forever())
