"""The aiohttp application of one API server process.

Work inside one request, in the steps of CONTRIBUTING.md's "One request, as folders" (nothing
is fetched before steps 1-3 pass):
  1 auth from the headers (401), admission (503), the body under a deadline and size cap
    (408/413, JSON only: 415), its JSON shape (400): see :mod:`engine.server.api.front_door`;
    model (404), fields (400)
  2-7 parts, item limits, options, media URL policy (400), fetch (bounded), decode + HF
    processor (cache): :mod:`engine.server.api.prepare`
  8 engine, tokens back as JSON or SSE: :mod:`engine.server.api.respond`.
Every error is the OpenAI shape; a bad item in a streaming request fails before the first SSE
byte. With ``--expose-request-timings`` each response carries the server-side stage timings and
cache hits: the header ``x-aphrodite-timings`` (JSON) and the body field ``aphrodite`` (for
streams, in the last chunk). Off by default: a cache hit tells a client that someone else sent
the same media.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.errors import (
    AphroditeError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
    internal_error_body,
)
from engine.media.inflight import Ticket
from engine.media.pool import decode_executor
from engine.models.loader import LoadedModel
from engine.processing.media_items import InProcessDecoders
from engine.server.api.admin_routes import ADMIN_PATHS, Access, add_admin_routes
from engine.server.api.backend import backend_for
from engine.server.api.fetch_slots import client_key
from engine.server.api.front_door import (
    auth_middleware,
    check_declared_length,
    parse_body,
    read_body,
)
from engine.server.api.metrics import REFRESH_S, Metrics
from engine.server.api.prepare import prepare_chat, prepare_prompts
from engine.server.api.request_ids import add_request_id_header, request_id_middleware
from engine.server.api.respond import respond
from engine.server.api.state import State
from engine.server.api.tenants import KEY_SALT
from engine.server.config import ServerConfig
from engine.server.process.engine_client import EngineClient
from engine.version import __version__

logger = logging.getLogger("aphrodite.server")


STATE = web.AppKey("state", object)
#: bodies larger than this are parsed on a worker thread, not on the event loop
OFF_LOOP_BYTES = 64 << 10


def body_cap(config: ServerConfig) -> int:
    """--max-request-body-mb in bytes."""
    return int(config.max_request_body_mb * (1 << 20))


def error_response(err: AphroditeError) -> web.Response:
    headers = {}
    if err.status in (429, 503):
        headers["Retry-After"] = str(getattr(err, "retry_after_s", 1))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(err.to_openai(), status=err.status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    state: State = request.app[STATE]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource \
        else "unmatched"
    try:
        response = await handler(request)
    except AphroditeError as err:
        response = error_response(err)
    except web.HTTPRequestEntityTooLarge:
        response = error_response(RequestTooLargeError(
            f"the request body is over {state.config.max_request_body_mb:g} MB",
            hint="send media by URL instead of inline, or raise --max-request-body-mb"))
    except ConnectionError:
        # The client went away mid-request: nothing to answer, not a server error. Counted
        # as 499 (nginx's "client closed request"). Returned, not raised: aiohttp logs a
        # handler's exception as a 500 with its traceback, while writing this answer to the
        # closed connection fails quietly.
        state.metrics.requests.labels(route, "499").inc()
        return web.Response(status=499)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = web.json_response({"error": {"message": exc.reason, "type":
                                                "invalid_request_error", "param": None,
                                                "code": str(exc.status)}}, status=exc.status)
        if "Allow" in exc.headers:  # a 405 says which methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception:
        logger.exception("unhandled error in %s", route)
        response = web.json_response(internal_error_body(), status=500)
    state.metrics.requests.labels(route, str(response.status)).inc()
    if not response.prepared:
        response.headers["x-aphrodite-api-server"] = str(os.getpid())
    return response


async def read_json(request: web.Request, ticket: Ticket,
                    check_counts: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The admitted request's body, read, its counts and lengths checked (``check_counts``:
    the text limits, before any per-item work), shape-checked (front_door), then its
    model."""
    state: State = request.app[STATE]
    body = await read_body(request, state.config.request_body_timeout_s, ticket,
                           body_cap(state.config))
    if len(body) > OFF_LOOP_BYTES:  # parsing and shape-checking a big body takes a while
        data = await asyncio.get_running_loop().run_in_executor(decode_executor(),
                                                                parse_body, body, check_counts)
    else:
        data = parse_body(body, check_counts)
    model = data.get("model")
    if model is not None and model != state.name:
        raise ModelNotFoundError(f"model {model!r} is not served here; this server serves "
                            f"{state.name!r}", hint="GET /v1/models lists it", param="model")
    return data


def admitted(handler):
    """At most --max-pending-requests generation requests in flight per API server; past
    that, a 503 with Retry-After at once instead of a queue that grows without bound. Runs
    after the API key check (a middleware), so only keyed clients are counted. The request's
    bytes in flight (body, then fetched media) are charged to one ticket, given back at the
    end."""
    async def wrapper(request: web.Request) -> web.StreamResponse:
        state: State = request.app[STATE]
        check_declared_length(request, body_cap(state.config))  # 413 before any charge
        if state.pending >= state.config.max_pending_requests:
            raise OverloadedError(
                f"this API server already has {state.pending} requests in flight",
                hint="retry after the Retry-After seconds, add API servers "
                     "(--api-server-count) or raise --max-pending-requests")
        state.count(pending=1)
        try:
            with state.inflight.ticket() as ticket:
                return await handler(request, ticket)
        finally:
            state.count(pending=-1)

    return wrapper


def _client(request: web.Request) -> str:
    """Whom a request's fetch and decode shares are counted against: its peer, or the
    client behind a --trusted-proxies gateway."""
    state: State = request.app[STATE]
    return client_key(state.trusted_proxies.client(
        request.remote, request.headers.getall("X-Forwarded-For", ())))


@admitted
async def chat_completions(request: web.Request, ticket: Ticket) -> web.StreamResponse:
    state: State = request.app[STATE]
    data = await read_json(request, ticket,  # text limits before templating and tokenizing
                           lambda body: state.text_limits.check_chat(body.get("messages"),
                                                                     body.get("tools")))
    start = time.perf_counter()
    fields, processed = await prepare_chat(state, data, ticket, _client(request),
                                           request.get(KEY_SALT))
    return await respond(request, state, fields, [processed], start, chat=True)


@admitted
async def completions(request: web.Request, ticket: Ticket) -> web.StreamResponse:
    """``prompt``: a string, a list of strings, a list of token ids or a list of lists of
    token ids; one engine request per prompt (see :mod:`engine.server.api.reply`)."""
    state: State = request.app[STATE]
    data = await read_json(request, ticket, lambda body: state.text_limits.check_prompt(
        body.get("prompt"), state.config.max_model_len))
    start = time.perf_counter()
    fields, processed = await prepare_prompts(state, data, request.get(KEY_SALT))
    return await respond(request, state, fields, processed, start, chat=False)


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    """A /tokenize switch, taken out of ``data``: a boolean, else a 400 naming it."""
    value = data.pop(name, default)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false", param=name)
    return value


def _switch(data: dict[str, Any], name: str, default: bool) -> None:
    """A /tokenize switch this server honours only at vLLM's default; the other value a 400
    naming it rather than a count that ignores it."""
    value = _flag(data, name, default)
    if value != default:
        raise InvalidRequestError(f"{name}={str(value).lower()} is not supported here",
                                  param=name, code="unsupported_parameter",
                                  hint=f"leave {name} out: the count is what the "
                                       f"completion routes would send the model")


@admitted
async def tokenize(request: web.Request, ticket: Ticket) -> web.Response:
    """vLLM's ``POST /tokenize``: ``prompt`` tokenized as ``/v1/completions`` does, or
    ``messages`` prepared as ``/v1/chat/completions`` does (media fetched, decoded and
    expanded into its tokens), so ``count`` is the ``prompt_tokens`` that route reports."""
    state: State = request.app[STATE]
    def limits(body: dict[str, Any]) -> None:  # each route's text limits, before any walk
        if "messages" in body:
            state.text_limits.check_chat(body.get("messages"), body.get("tools"))
        else:
            state.text_limits.check_prompt(body.get("prompt"), state.config.max_model_len)

    data = await read_json(request, ticket, limits)
    strings = _flag(data, "return_token_strs", False)
    if "messages" in data:
        _switch(data, "add_generation_prompt", True)
        _switch(data, "continue_final_message", False)
        _, one = await prepare_chat(state, data, ticket, _client(request),
                                    request.get(KEY_SALT))
        if one.text is not None and one.mm:
            raise InvalidRequestError(
                "with --engine vllm, vLLM's processor expands media: this server cannot "
                "count a chat's media tokens", param="messages",
                code="unsupported_parameter", hint="count a text-only chat, or ask vLLM")
    else:
        _switch(data, "add_special_tokens", True)
        if not isinstance(data.get("prompt"), str):
            raise InvalidRequestError("prompt must be a string (or send messages)",
                                      param="prompt")
        _, (one,) = await prepare_prompts(state, {"prompt": data["prompt"]})
    ids = list(one.input_ids)
    return web.json_response({
        "count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids,
        "token_strs": state.loaded.tokenizer.convert_ids_to_tokens(ids) if strings else None})


@admitted
async def detokenize(request: web.Request, ticket: Ticket) -> web.Response:
    """vLLM's ``POST /detokenize``: ``tokens`` (ids of this model's vocabulary, at most
    --max-model-len of them) back to text."""
    state: State = request.app[STATE]
    tokens = (await read_json(request, ticket, lambda body: None)).get("tokens")
    if not isinstance(tokens, list) or len(tokens) > state.config.max_model_len or not all(
            type(t) is int and 0 <= t < state.vocab_size for t in tokens):
        raise InvalidRequestError(
            f"tokens must be a list of at most {state.config.max_model_len} token ids, each "
            f"from 0 to {state.vocab_size - 1}", param="tokens")
    text = await asyncio.get_running_loop().run_in_executor(
        decode_executor(), state.loaded.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})


def _model_card(state: State) -> dict[str, Any]:
    """vLLM's model card: ``root`` is where the weights came from (the Hub id, or the local
    folder, a ``tiny:ARCH`` model's too), so a client can load the same tokenizer."""
    return {"id": state.name, "object": "model", "created": 0, "owned_by": "aphrodite",
            "root": state.loaded.repo or str(state.loaded.path), "parent": None,
            "max_model_len": state.config.max_model_len,
            "modalities": list(state.loaded.spec.modalities)}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the served model, or 404 for any other id."""
    state: State = request.app[STATE]
    if request.match_info["model"] != state.name:
        raise ModelNotFoundError(f"model {request.match_info['model']!r} is not served here; "
                                 f"this server serves {state.name!r}",
                                 hint="GET /v1/models lists it", param="model")
    return web.json_response(_model_card(state))


async def health(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    if not state.engine.alive:
        return web.json_response({"status": "engine down"}, status=503)
    return web.json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    state.metrics.set_engine(await state.engine.stats())
    return web.Response(body=state.metrics.render(), content_type="text/plain")


async def _refresh_metrics(metrics: Metrics) -> None:
    """Several API servers: write this process's gauges for its siblings' scrapes."""
    while True:
        metrics.refresh()
        await asyncio.sleep(REFRESH_S)


def create_app(config: ServerConfig, loaded: LoadedModel, engine: EngineClient
               ) -> web.Application:
    """The app factory: state lives in an AppKey, cleanup in cleanup_ctx."""
    app = web.Application(middlewares=[errors_middleware, request_id_middleware,
                                       auth_middleware(config.api_key,
                                                       config.metrics_without_auth,
                                                       ADMIN_PATHS,
                                                       config.cache_salt_per_api_key)],
                          client_max_size=int(config.max_request_body_mb * 1024 * 1024))

    async def lifecycle(app: web.Application):
        app[STATE] = State(config, loaded, engine, backend_for(config))
        refresher = (asyncio.create_task(_refresh_metrics(app[STATE].metrics))
                     if app[STATE].metrics.multiprocess else None)
        yield
        if refresher is not None:
            refresher.cancel()
        await app[STATE].connector.close()
        if not isinstance(app[STATE].decoders, InProcessDecoders):
            app[STATE].decoders.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_response_prepare.append(add_request_id_header)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/ping", health)  # vLLM's (SageMaker's) health check
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, STATE, Access(config.admin_api_key, config.api_key,
                                        config.server_dev_mode))
    return app
