"""The aiohttp application of one API server process.

Work inside one request, in this order (nothing is fetched before step 6):
  1 auth from the headers (401), admission (503), the body under a deadline and size cap
    (408/413, JSON only: 415), its JSON shape (400): see :mod:`engine.server.front_door`
  2 model (404)  3 fields (400)  4 parts, item limits, options  6 media URL policy (400)
  7 fetch (bounded)  8 decode + HF processor (cache)  9 engine.
Every error is the OpenAI shape; a bad item in a streaming request fails before the first SSE
byte. With ``--expose-request-timings`` each response carries the server-side stage timings and
cache hits: the header ``x-aphrodite-timings`` (JSON) and the body field ``aphrodite`` (for
streams, in the last chunk). Off by default: a cache hit tells a client that someone else sent
the same media.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any

from aiohttp import web

from engine.errors import (
    AphroditeError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
)
from engine.media.inflight import InflightBytes, Ticket
from engine.media.pool import decode_executor
from engine.media.video import load_video_async
from engine.media.video.backend_info import BACKENDS
from engine.media.video.budget import GpuDecodeBudget
from engine.models.loader import LoadedModel
from engine.processing.chat_parts import parse_messages
from engine.processing.media_items import use_frames
from engine.processing.pipeline import Pipeline
from engine.processing.preprocess import ProcessedPrompt
from engine.server.admin_routes import add_admin_routes
from engine.server.config import ServerConfig
from engine.server.engine_client import EngineClient
from engine.server.fetch_slots import FetchSlots, client_key
from engine.server.front_door import auth_middleware, parse_body, read_body
from engine.server.logprobs import TokenStrings
from engine.server.metrics import REFRESH_S, Metrics
from engine.server.protocol import parse_generation_fields, parse_prompts
from engine.server.respond import respond
from engine.timings import zero_preprocess_timings
from engine.version import __version__

logger = logging.getLogger("aphrodite.server")


STATE = web.AppKey("state", object)


class State:
    """Everything a handler needs, built once per API server process."""

    def __init__(self, config: ServerConfig, loaded: LoadedModel, engine: EngineClient) -> None:
        self.config = config
        self.loaded = loaded
        self.engine = engine
        self.name = config.served_model_name or loaded.name
        self.pipeline = Pipeline(loaded, config.pipeline)
        self.preprocessor = self.pipeline.preprocessor
        self.token_strings = TokenStrings(loaded.tokenizer)
        #: token ids a prompt may hold: the tokenizer's and the model's vocabulary
        self.vocab_size = min(len(loaded.tokenizer), loaded.config.get("vocab_size") or (
            loaded.config.get("text_config") or {}).get("vocab_size") or 1 << 62)
        self.media_limits = self.pipeline.media_limits
        self.connector = self.pipeline.connector()
        self.fetch_slots = FetchSlots(config.max_concurrent_fetches,
                                      config.max_fetches_per_client)
        self.metrics = Metrics()
        self.pending = 0
        self.decoders = None
        if config.decode_isolation == "process":
            from engine.media.isolation import DecodeWorkers

            self.decoders = DecodeWorkers(
                config.decode_workers, timeout_s=config.decode_timeout_s,
                memory_limit_bytes=int(config.decode_memory_gb * (1 << 30)),
                max_waiting=config.max_decode_queue)
        self.inflight = InflightBytes(int(config.max_inflight_media_mb * (1 << 20)))
        self.preprocessing = 0  # requests fetching, decoding or in the HF processor
        self.metrics.sample(self.metrics.inflight_bytes, lambda: self.inflight.in_use)
        decoders = self.decoders
        if decoders is not None:
            self.metrics.follow(self.metrics.decode_restarts, lambda: decoders.restarts)
        self.count()
        # This process's share of --mm-ipc-gpu-memory-gb, for GPU video backends.
        self.gpu_budget = (GpuDecodeBudget.from_gb(config.mm_ipc_gpu_memory_gb,
                                                   config.api_server_count)
                           if config.mm_ipc_gpu_memory_gb > 0 else None)

    def count(self, *, pending: int = 0, preprocessing: int = 0) -> None:
        """Requests in flight / preprocessing change here, and vLLM's running and waiting
        gauges with them (written at once: a sibling API server's scrape reads them)."""
        self.pending += pending
        self.preprocessing += preprocessing
        self.metrics.vllm_waiting.labels(self.name).set(self.preprocessing)
        self.metrics.vllm_running.labels(self.name).set(max(self.pending - self.preprocessing,
                                                            0))


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
        # as 499 (nginx's "client closed request"); aiohttp drops the connection quietly.
        state.metrics.requests.labels(route, "499").inc()
        raise
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
        response = web.json_response({"error": {"message": "internal server error", "type":
                                                "internal_error", "param": None,
                                                "code": "internal_error"}}, status=500)
    state.metrics.requests.labels(route, str(response.status)).inc()
    if not response.prepared:
        response.headers["x-aphrodite-api-server"] = str(os.getpid())
    return response


async def read_json(request: web.Request, ticket: Ticket) -> dict[str, Any]:
    """The admitted request's body, read and shape-checked (front_door), then its model."""
    state: State = request.app[STATE]
    data = parse_body(await read_body(request, state.config.request_body_timeout_s, ticket))
    model = data.get("model")
    if model is not None and model != state.name:
        raise ModelNotFoundError(f"model {model!r} is not served here; this server serves "
                            f"{state.name!r}", hint="GET /v1/models lists it", param="model")
    return data


async def prepare_chat(state: State, data: dict[str, Any], ticket: Ticket, client: str = ""):
    """Steps 4-8: everything before the engine; raises before any response byte. Fetched
    media is charged to ``ticket`` (the request's share of the bytes in flight); ``client``
    (the peer address) bounds its share of the fetch slots."""
    fields = parse_generation_fields(data, max_tokens_cap=state.config.max_tokens_cap)
    parsed = parse_messages(data.get("messages"))
    counts = Counter(parsed.counts())
    pipeline = state.pipeline
    pipeline.check_counts(counts)
    video = pipeline.video_for(fields.media_io_kwargs)
    kwargs = pipeline.kwargs_for(fields.mm_processor_kwargs)
    text = pipeline.render(parsed.messages)
    items, fetch_s = [], 0.0
    # Only requests with media take a decode-queue slot: text never waits behind video.
    with preprocess_slot(state) if parsed.media else contextlib.nullcontext():
        if parsed.media:
            sources = await pipeline.check_sources(state.connector, parsed.media)
            started = asyncio.get_running_loop().time()  # fetch deadlines include queueing
            async with fetch_slot(state, sources, started, client):
                items, fetch_s = await pipeline.fetch(
                    state.connector, parsed.media, video, sources=sources,
                    decoders=state.decoders, ticket=ticket, started=started)
            for item in items:
                state.metrics.media_bytes.labels(item.modality).inc(len(item.encoded or b""))
            if state.gpu_budget is not None and BACKENDS[video.backend].gpu:
                await decode_gpu_videos(state, items, video)
        loop = asyncio.get_running_loop()
        processed = await loop.run_in_executor(decode_executor(), pipeline.process,
                                               text, items, kwargs)
    processed.timings["fetch_s"] = fetch_s
    for hit in processed.item_hits:
        state.metrics.cache.labels("hit" if hit else "miss").inc()
    if counts.get("video") and processed.timings["media_decode_s"]:
        state.metrics.video_decode.labels(video.backend).observe(
            processed.timings["media_decode_s"])
    return fields, processed


@contextlib.asynccontextmanager
async def fetch_slot(state: State, sources: list, started: float, client: str):
    """One of --max-concurrent-fetches (at most --max-fetches-per-client per client), for a
    request with http(s) media only (data URLs and local files are read at once). Waiting
    counts against the fetch deadline: a request that gets no slot before its shortest media
    fetch timeout is a 503, not a wait without end."""
    remote = [s for s in sources if s.kind == "http"]
    if not remote:
        yield
        return
    timeout = min(state.media_limits.for_modality(s.modality).fetch_timeout_s for s in remote)
    async with state.fetch_slots.hold(client, started + timeout, timeout):
        yield


@contextlib.contextmanager
def preprocess_slot(state: State):
    """At most --max-decode-queue requests fetching, decoding or preprocessing per API server;
    past that a 503 with Retry-After at once (the decode pool's queue stays bounded)."""
    if state.preprocessing >= state.config.max_decode_queue:
        raise OverloadedError(
            f"this API server already has {state.preprocessing} requests fetching, "
            "decoding or preprocessing media", code="decode_queue_full",
            hint="retry after the Retry-After seconds, or raise --max-decode-queue")
    state.count(preprocessing=1)
    try:
        yield
    finally:
        state.count(preprocessing=-1)


async def decode_gpu_videos(state: State, items: list, video) -> None:
    """GPU decodes hold this process's budget share while they run (they wait, first come
    first served, when it is used up); an item bigger than the share is a 413."""
    for item in items:
        if item.modality != "video" or item.encoded is None:
            continue
        task = load_video_async(item.encoded, video, state.media_limits, state.gpu_budget)
        state.metrics.gpu_budget.set(state.gpu_budget.in_use)
        try:
            item.decoded = use_frames(item, await task)
        finally:
            state.metrics.gpu_budget.set(state.gpu_budget.in_use)


def admitted(handler):
    """At most --max-pending-requests generation requests in flight per API server; past
    that, a 503 with Retry-After at once instead of a queue that grows without bound. Runs
    after the API key check (a middleware), so only keyed clients are counted. The request's
    bytes in flight (body, then fetched media) are charged to one ticket, given back at the
    end."""
    async def wrapper(request: web.Request) -> web.StreamResponse:
        state: State = request.app[STATE]
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


@admitted
async def chat_completions(request: web.Request, ticket: Ticket) -> web.StreamResponse:
    state: State = request.app[STATE]
    data = await read_json(request, ticket)
    start = time.perf_counter()
    fields, processed = await prepare_chat(state, data, ticket, client_key(request.remote))
    return await respond(request, state, fields, [processed], start, chat=True)


@admitted
async def completions(request: web.Request, ticket: Ticket) -> web.StreamResponse:
    """``prompt``: a string, a list of strings, a list of token ids or a list of lists of
    token ids; one engine request per prompt (see :mod:`engine.server.respond`)."""
    state: State = request.app[STATE]
    data = await read_json(request, ticket)
    start = time.perf_counter()
    fields = parse_generation_fields(data, max_tokens_cap=state.config.max_tokens_cap,
                                     chat=False)
    prompts = parse_prompts(data.get("prompt"), state.vocab_size,
                            set(state.preprocessor.expansion_ids.values())
                            | set(state.preprocessor.feature_ids.values()))
    loop = asyncio.get_running_loop()
    processed = []
    for prompt in prompts:
        if isinstance(prompt, str):
            one = await loop.run_in_executor(decode_executor(), state.pipeline.process,
                                             prompt, [])
        else:
            one = ProcessedPrompt(prompt, {}, [], zero_preprocess_timings(), {})
        if not one.input_ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", param="prompt")
        one.timings["fetch_s"] = 0.0
        processed.append(one)
    return await respond(request, state, fields, processed, start, chat=False)


async def models(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.name, "object": "model", "created": 0, "owned_by": "aphrodite",
        "max_model_len": state.config.max_model_len,
        "modalities": list(state.loaded.spec.modalities)}]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the served model, or 404 for any other id."""
    state: State = request.app[STATE]
    if request.match_info["model"] != state.name:
        raise ModelNotFoundError(f"model {request.match_info['model']!r} is not served here; "
                                 f"this server serves {state.name!r}",
                                 hint="GET /v1/models lists it", param="model")
    return web.json_response({"id": state.name, "object": "model", "created": 0,
                              "owned_by": "aphrodite",
                              "max_model_len": state.config.max_model_len,
                              "modalities": list(state.loaded.spec.modalities)})


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
    app = web.Application(middlewares=[errors_middleware, auth_middleware(
                              config.api_key, config.metrics_without_auth)],
                          client_max_size=int(config.max_request_body_mb * 1024 * 1024))

    async def lifecycle(app: web.Application):
        app[STATE] = State(config, loaded, engine)
        refresher = (asyncio.create_task(_refresh_metrics(app[STATE].metrics))
                     if app[STATE].metrics.multiprocess else None)
        yield
        if refresher is not None:
            refresher.cancel()
        await app[STATE].connector.close()
        if app[STATE].decoders is not None:
            app[STATE].decoders.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app)
    return app
