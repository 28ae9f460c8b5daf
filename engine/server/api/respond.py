"""Step 8 of a request (CONTRIBUTING.md's "One request, as folders"): its prompts through the
engine, answered as OpenAI's JSON (:func:`respond_json`) or SSE (:func:`respond_stream`); the
two build their choices, usage and extension with one :class:`~engine.server.api.reply.Reply`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.errors import AphroditeError, internal_error_body
from engine.executor.grammar import bounded_strings
from engine.executor.sampling import MAX_TOKENS_CAP
from engine.server.api.reply import Reply
from engine.server.api.request_ids import request_id
from engine.server.api.sequence_admission import sequences_charged
from engine.server.process.wire import Done

logger = logging.getLogger("aphrodite.server")

_DONE = object()


async def merge(generations: list) -> AsyncIterator[tuple[int, Any]]:
    """(generation index, message) from several engine generations as they come. Closing
    this (or cancelling its consumer) cancels every generation still running."""
    if len(generations) == 1:
        try:
            async for message in generations[0]:
                yield 0, message
        finally:
            await generations[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, generation) -> None:
        try:
            async for message in generation:
                queue.put_nowait((i, message))
            queue.put_nowait((i, _DONE))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    left = len(tasks)
    try:
        while left:
            i, message = await queue.get()
            if message is _DONE:
                left -= 1
            elif isinstance(message, Exception):
                raise message
            else:
                yield i, message
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _timing_header(timings: dict[str, Any]) -> str:
    return json.dumps(timings, separators=(",", ":"), default=str)


async def respond(request: web.Request, state, fields, prompts: list, start: float,
                  *, chat: bool) -> web.StreamResponse:
    """Run ``prompts`` (processed) with ``fields`` and answer; raises (nothing sent yet) when
    a prompt does not fit the model length."""
    param = "messages" if chat else "prompt"
    params = [fields.sampling_for(len(p.input_ids), state.config.max_model_len, param)
              for p in prompts]
    with sequences_charged(state, len(prompts) * fields.sampling.n):
        return await _respond(request, state, fields, prompts, params, start, chat=chat)


async def _respond(request: web.Request, state, fields, prompts: list, params: list,
                   start: float, *, chat: bool) -> web.StreamResponse:
    generations = state.backend.generate(state, fields, prompts, params)
    reply = Reply(state, fields, prompts, start, chat=chat, request_id=request_id(request))
    if fields.stream:
        return await respond_stream(request, reply, generations)
    return await respond_json(request, reply, generations)


def sampling_for_engine(params: Any, fields: Any, vllm: bool) -> dict[str, Any]:
    """The engine's sampling fields. vLLM counts the prompt after its processor expanded the
    placeholders, so for a request without ``max_tokens`` the room left is vLLM's to find: it
    gets the server's max-tokens cap and stops at the model length if that comes first (its
    scheduler ends a sequence there), as this engine's requests are capped. A JSON schema
    goes to vLLM with its bounded strings rewritten as this engine compiles them
    (:func:`~engine.executor.grammar.bounded_strings`)."""
    sampling = dict(params.__dict__)
    if vllm and fields.max_tokens is None:
        sampling["max_tokens"] = min(fields.max_tokens_cap, MAX_TOKENS_CAP)
    spec = sampling.get("structured_outputs")
    if vllm and spec is not None and spec.kind == "json":
        # vLLM's xgrammar (0.2.8, as ours) lets a length-bounded JSON string hold raw control
        # characters, which JSON forbids: the schema goes as this engine compiles it
        sampling["structured_outputs"] = spec._replace(text=json.dumps(
            bounded_strings(json.loads(spec.text)), separators=(",", ":")))
    return sampling


async def respond_json(request: web.Request, reply: Reply, generations: list
                       ) -> web.StreamResponse:
    """The whole answer as one JSON body, once every prompt finished; 499 (counted, never
    sent) when the client went away first."""
    done: dict[int, Done] = {}
    ext: dict[str, Any] = {}
    merged = merge(generations)
    async for i, message in merged:
        if request.transport is None or request.transport.is_closing():
            # The client went away (aiohttp does not cancel the handler): stop generating.
            # 499 (nginx's "client closed request") is counted, and never sent.
            await merged.aclose()
            return web.Response(status=499)
        if isinstance(message, Done):
            done[i] = message
            ext = reply.extension(i, message)
        else:
            at = reply.at(i, message.index)
            if message.token_id is not None:
                reply.tick(at)
            reply.add_logprobs(at, message.token_id, message.logprobs)
    choices = []
    total = 0
    for i in range(len(reply.prompts)):
        for out in done[i].outputs if i in done else ():
            total += len(out.token_ids)
            at = reply.at(i, out.index)
            choices.append(reply.choice(at, out.text, out.finish_reason, reply.logprobs(at),
                                        stop_reason=out.stop_reason))
    choices.sort(key=lambda c: c["index"])
    body = {**reply.envelope(choices, chunk=False), "usage": reply.usage(total)}
    if not reply.state.config.expose_request_timings:
        return web.json_response(body)
    body["aphrodite"] = ext = ext or reply.extension(0, None)
    return web.json_response(body, headers={"x-aphrodite-timings":
                                            _timing_header(ext["timings"])})


async def respond_stream(request: web.Request, reply: Reply, generations: list
                         ) -> web.StreamResponse:
    """Server-sent events: a chunk per row and step, then (when asked) a last chunk with the
    usage and the extension, then ``[DONE]``. After the headers an error is one SSE event."""
    state = reply.state
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "x-aphrodite-request-id": reply.id,
                                           "x-aphrodite-api-server": str(os.getpid())})

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    started: set[int] = set()
    completion_tokens = 0
    finished = 0
    merged = merge(generations)
    try:
        # (inside the try: a client gone before its headers must cancel its requests too)
        await response.prepare(request)
        async for i, message in merged:
            if isinstance(message, Done):
                ext = reply.extension(i, message)
                finished += 1
                if finished == len(reply.prompts):
                    tail = reply.envelope([], chunk=True)
                    if state.config.expose_request_timings:
                        tail["aphrodite"] = ext
                    if reply.fields.include_usage or reply.fields.continuous_usage:
                        tail["usage"] = reply.usage(completion_tokens)
                    if "aphrodite" in tail or "usage" in tail:
                        await send(tail)
                continue
            at = reply.at(i, message.index)
            if message.token_id is not None:
                completion_tokens += 1
                reply.tick(at)
            piece = reply.add_logprobs(at, message.token_id, message.logprobs)
            choice = reply.stream_choice(at, message.text, message.finish_reason, piece,
                                         first=at not in started,
                                         stop_reason=message.stop_reason)
            if choice is not None:
                chunk = reply.envelope([choice], chunk=True)
                if reply.fields.continuous_usage:  # vLLM's usage so far, on every chunk
                    chunk["usage"] = reply.usage(completion_tokens)
                await send(chunk)
                started.add(at)
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        await merged.aclose()  # cancels the requests in the engine
        raise
    except Exception as exc:
        # The headers are out: an error travels as one SSE event in the OpenAI error shape
        # (as OpenAI and vLLM send it), never as a second HTTP response inside the body.
        await merged.aclose()
        err = exc if isinstance(exc, AphroditeError) else None
        if err is None:
            logger.exception("stream %s failed", reply.id)
        body = err.to_openai() if err is not None else internal_error_body()
        await send(body)
        await response.write(b"data: [DONE]\n\n")
        state.metrics.stream_errors.labels(str(err.status if err else 500)).inc()
    return response
