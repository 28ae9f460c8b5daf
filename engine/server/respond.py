"""Step 9 of a request: its prompts through the engine, answered as OpenAI's JSON or SSE.

A chat request has one prompt; a text completion may have several (``prompt`` as a list):
each is its own engine request of ``n`` rows, and choice ``index`` is ``prompt_index * n +
sample`` as OpenAI numbers them. Usage sums over the prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.errors import AphroditeError
from engine.server.engine_client import Completion
from engine.server.logprobs import CompletionLogprobs, TokenStrings, chat_entry
from engine.timings import SERVED_STAGES

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


def _reason(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason) if reason else None


async def respond(request: web.Request, state, fields, prompts: list, start: float,
                  *, chat: bool) -> web.StreamResponse:
    """Run ``prompts`` (processed) with ``fields`` and answer; raises (nothing sent yet) when
    a prompt does not fit the model length."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    param = "messages" if chat else "prompt"
    params = [fields.sampling_for(len(p.input_ids), state.config.max_model_len, param)
              for p in prompts]
    n = fields.sampling.n
    generations = [state.engine.generate(p.input_ids, p.mm, sp.__dict__,
                                         (p.mm_hashes, p.mm_positions))
                   for p, sp in zip(prompts, params, strict=True)]
    obj = "chat.completion" if chat else "text_completion"
    usage_prompt = sum(len(p.input_ids) for p in prompts)
    strings: TokenStrings = state.token_strings
    cached_tokens: dict[int, int] = {}  # per prompt, from the prefix cache

    def usage(completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens the prefix cache supplied (as OpenAI and
        vLLM report them)."""
        return {"prompt_tokens": usage_prompt, "completion_tokens": completion_tokens,
                "total_tokens": usage_prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(cached_tokens.values())}}

    def extension(i: int, completion: Completion | None) -> dict[str, Any]:
        processed = prompts[i]
        timings = {**processed.timings, **(completion.timings if completion else {}),
                   "server_total_s": round(time.perf_counter() - start, 6)}
        if completion is not None:
            state.metrics.observe_request(
                state.name, e2e_s=timings["server_total_s"],
                decode_s=float(timings.get("decode_s", 0.0)),
                prompt=len(processed.input_ids),
                generated=sum(len(ids) for _, _, ids, _ in completion.outputs),
                cached=completion.num_cached_tokens)
            cached_tokens[i] = completion.num_cached_tokens
        for name in SERVED_STAGES:
            if name in timings:
                state.metrics.stage.labels(name[:-2]).observe(float(timings[name]))
        # several prompts: the timings of the one that finished last (the request's end)
        return {"timings": timings, "cache_hits": [h for p in prompts for h in p.item_hits]}

    def new_logprobs() -> Any:
        if not fields.logprobs:
            return None
        return [] if chat else CompletionLogprobs(strings, fields.tokens_as_ids)

    if not fields.stream:
        completions: dict[int, Completion] = {}
        logprobs: dict[int, Any] = {}
        ext: dict[str, Any] = {}
        merged = merge(generations)
        async for i, message in merged:
            if request.transport is None or request.transport.is_closing():
                # The client went away (aiohttp does not cancel the handler): stop generating.
                # 499 (nginx's "client closed request") is counted, and never sent.
                await merged.aclose()
                return web.Response(status=499)
            if isinstance(message, Completion):
                completions[i] = message
                ext = extension(i, message)
                continue
            _, _, index, token_id, _, _, lp = message
            if lp is not None and token_id is not None:
                target = logprobs.setdefault(i * n + index, new_logprobs())
                if chat:
                    target.append(chat_entry(strings, token_id, lp, fields.tokens_as_ids))
                else:
                    target.add(token_id, lp)
        choices = []
        total = 0
        for i in range(len(prompts)):
            for index, text, token_ids, reason in completions.get(i, Completion()).outputs:
                total += len(token_ids)
                at = i * n + index
                lps = logprobs.get(at) or new_logprobs()
                if lps is not None:
                    lps = {"content": lps} if chat else lps.body()
                choices.append({"index": at, "finish_reason": _reason(reason),
                                **({"message": {"role": "assistant", "content": text}} if chat
                                   else {"text": text}), "logprobs": lps})
        choices.sort(key=lambda c: c["index"])
        body = {"id": rid, "object": obj, "created": created, "model": state.name,
                "choices": choices, "usage": usage(total)}
        if not state.config.expose_request_timings:
            return web.json_response(body)
        body["aphrodite"] = ext = ext or extension(0, None)
        return web.json_response(body, headers={"x-aphrodite-timings":
                                                _timing_header(ext["timings"])})

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "x-aphrodite-request-id": rid,
                                           "x-aphrodite-api-server": str(os.getpid())})
    await response.prepare(request)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    streams: dict[int, CompletionLogprobs] = {}

    def chunk(index: int, delta: str, reason: str | None, first: bool, token_id: int | None,
              lp: tuple | None) -> dict[str, Any]:
        piece = None
        if lp is not None and token_id is not None and fields.logprobs:
            if chat:
                piece = {"content": [chat_entry(strings, token_id, lp, fields.tokens_as_ids)]}
            else:
                piece = streams.setdefault(index, CompletionLogprobs(
                    strings, fields.tokens_as_ids)).add(token_id, lp)
        if chat:
            d: dict[str, Any] = {"content": delta}
            if first:
                d["role"] = "assistant"
            choice = {"index": index, "delta": d, "finish_reason": _reason(reason),
                      "logprobs": piece}
        else:
            choice = {"index": index, "text": delta, "finish_reason": _reason(reason),
                      "logprobs": piece}
        return {"id": rid, "object": chunk_obj, "created": created, "model": state.name,
                "choices": [choice]}

    started: set[int] = set()
    completion_tokens = 0
    finished = 0
    merged = merge(generations)
    try:
        async for i, message in merged:
            if isinstance(message, Completion):
                ext = extension(i, message)
                finished += 1
                if finished < len(prompts):
                    continue
                tail: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created,
                                        "model": state.name, "choices": []}
                if state.config.expose_request_timings:
                    tail["aphrodite"] = ext
                if fields.include_usage:
                    tail["usage"] = usage(completion_tokens)
                if "aphrodite" in tail or "usage" in tail:
                    await send(tail)
                continue
            _, _, index, token_id, delta, reason, lp = message
            at = i * n + index
            if token_id is not None:
                completion_tokens += 1
            await send(chunk(at, delta, reason, at not in started, token_id, lp))
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
            logger.exception("stream %s failed", rid)
        body = err.to_openai() if err is not None else {"error": {
            "message": "internal server error", "type": "internal_error", "param": None,
            "code": "internal_error"}}
        await send(body)
        await response.write(b"data: [DONE]\n\n")
        state.metrics.stream_errors.labels(str(err.status if err else 500)).inc()
    return response
