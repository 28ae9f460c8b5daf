"""A mock OpenAI-compatible endpoint that streams tokens with a set TTFT and inter-token delay:
the load generator's measurements are checked against it."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


async def _sleep_until(due: float) -> None:
    """Sleep to ``due`` (perf_counter seconds): an absolute schedule, so per-token delays do
    not accumulate the event loop's wake-up lateness."""
    delay = due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def create_app(ttft_ms: float, itl_ms: float, output_tokens: int | None,
               headers_ms: float = 0.0, *, model: str = "mock",
               require_model: bool = False, max_concurrency: int | None = None,
               usage: bool = True, seen: list[dict] | None = None) -> web.Application:
    """``headers_ms``: when a stream's response headers go out (capped at the TTFT); a real
    server may send them at once or only with the first token, and a client must time the
    first token from its request either way, never from the headers. With the headers goes
    the role chunk (``{"role": "assistant", "content": ""}``) that vLLM and others send first:
    it holds no token. ``require_model``: a request without ``model`` (or with another) gets
    the OpenAI API's 400, as guidellm's mock and real servers answer. ``max_concurrency``:
    ``max_concurrency`` servers, each serving one request at a time for TTFT + ITL x (tokens
    - 1); a request waits for the first free one. The servers keep their schedule on a clock
    of their own (a server is free at its last request's scheduled end, not when the event
    loop got round to finishing it), so the mock's own overhead and wake-up lateness cost it
    no throughput: its capacity is ``max_concurrency`` / (TTFT + ITL x (tokens - 1))
    requests per second exactly, overhead included, as long as it has the CPU to keep up.
    ``seen``: each request that arrives is appended to it as it arrives (its ``headers`` and
    ``body`` as sent), with the ``tokens`` streamed and whether the client ``disconnected``
    mid-stream: what a test asserts the client put on the wire."""
    headers_ms = min(headers_ms, ttft_ms)
    free_at = [0.0] * (max_concurrency or 0)  # perf_counter when each server is free

    async def chat(request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()  # delays count from the request's arrival (or its server)
        body = await request.json()
        entry = {"path": request.path, "headers": dict(request.headers), "body": body, "tokens": 0,
                 "disconnected": False}
        if seen is not None:
            seen.append(entry)
        if require_model and body.get("model") != model:
            return web.json_response({"error": {
                "message": f"The model `{body.get('model')}` does not exist; this server "
                           f"serves `{model}`.", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}, status=400)
        n = int(output_tokens or body.get("max_tokens") or body.get("max_completion_tokens")
                or 16)
        if free_at:  # the first free server takes it, on the servers' own clock
            server = min(range(len(free_at)), key=free_at.__getitem__)
            start = max(start, free_at[server])
            free_at[server] = start + (ttft_ms + itl_ms * max(n - 1, 0)) / 1000
            await _sleep_until(start)
        chat_api = request.path.endswith("chat/completions")
        rid = f"mock-{time.monotonic_ns()}"
        if not body.get("stream"):
            await _sleep_until(start + (ttft_ms + itl_ms * max(n - 1, 0)) / 1000)
            text = " tok" * n
            choice = ({"message": {"role": "assistant", "content": text}} if chat_api
                      else {"text": text})
            return web.json_response({"id": rid, "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "length", **choice}],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await _sleep_until(start + headers_ms / 1000)
        try:
            await _stream(request, response, body, n, start, chat_api, rid, entry)
        except ConnectionResetError:  # the client closed the connection mid-answer
            entry["disconnected"] = True
        except asyncio.CancelledError:  # ... and aiohttp cancelled the handler for it
            entry["disconnected"] = True
            raise
        return response

    async def _stream(request: web.Request, response: web.StreamResponse, body: dict, n: int,
                      start: float, chat_api: bool, rid: str, entry: dict) -> None:
        await response.prepare(request)
        if chat_api:
            role = {"id": rid, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
        for i in range(n):
            # Sleep to an absolute schedule so delays do not accumulate error.
            await _sleep_until(start + (ttft_ms + itl_ms * i) / 1000)
            delta = {"content": " tok"} if chat_api else None
            choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None,
                      **({"delta": delta} if chat_api else {"text": " tok"})}
            await response.write(b"data: " + json.dumps(
                {"id": rid, "object": "chat.completion.chunk", "choices": [choice]}).encode()
                + b"\n\n")
            entry["tokens"] += 1
        if usage and (body.get("stream_options") or {}).get("include_usage"):
            # only when asked for, as the OpenAI API does
            tally = {"id": rid, "object": "chat.completion.chunk", "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": n,
                               "total_tokens": n + 1}}
            await response.write(b"data: " + json.dumps(tally).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")

    async def models(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/v1/models", models)
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/health", health)
    return app
