"""`aphrodite bench serve`: an asyncio/aiohttp load generator for OpenAI-compatible chat
endpoints, with cold-media and warm-cache phases measured separately."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from aphrodite_cli.bench.data.datasets import BenchRequest, MediaSpec, media_url, render_media
from aphrodite_cli.bench.harness.media_host import MediaHost
from aphrodite_cli.bench.load import sse_client
from aphrodite_cli.bench.load.metrics import FORMULAS, RequestRecord, compute
from aphrodite_cli.bench.load.wire import cancelled_indices, request_headers
from aphrodite_cli.bench.results.escape import printable
from aphrodite_cli.options import MediaDelivery, RampUpStrategy, TtftFrom

#: Where a chat benchmark posts, relative to the server's root (vLLM's --endpoint default).
CHAT_ENDPOINT = "/v1/chat/completions"


def server_root(base_url: str) -> str:
    """The server's root from ``--base-url``: vLLM's convention (``http://host:port``) and
    the OpenAI clients' (``http://host:port/v1``) both work, as does a full endpoint URL."""
    root = base_url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/v1"):
        root = root.removesuffix(suffix)
    return root


#: The most of ``GET /v1/models`` read: a list of thousands of models is well under it
MAX_MODELS_BYTES = 1 << 20


def first_model(root: str, api_key: str | None, timeout_s: float = 30.0,
                headers: dict[str, str] | None = None) -> tuple[str, str | None]:
    """The first model of ``GET {root}/v1/models``, as vLLM's client picks one when no
    ``--model`` is given: its id, and its ``root`` (vLLM's field: the folder or Hub id the
    weights came from; None when the server sends none or not a string). At most
    :data:`MAX_MODELS_BYTES` and ``timeout_s`` seconds in all: an endless or trickling answer
    is an error, not a hang."""
    import urllib.error
    import urllib.request

    from engine.errors import ConfigError

    url = f"{root}/v1/models"
    req = urllib.request.Request(url, headers=request_headers(api_key, headers,
                                                              json_body=False))
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = b""
            while piece := resp.read1(65536):
                body += piece
                if len(body) > MAX_MODELS_BYTES or time.monotonic() > deadline:
                    raise ConfigError(
                        f"GET {url} sent more than {MAX_MODELS_BYTES} bytes"
                        if len(body) > MAX_MODELS_BYTES else
                        f"GET {url} took more than {timeout_s:g} s",
                        hint="pass --model NAME", code="model_unknown")
            entries = json.loads(body)["data"]
            models = [m["id"] for m in entries]
    except urllib.error.HTTPError as err:
        raise ConfigError(f"GET {url} answered {err.code}, so no model could be picked",
                          hint="pass --model NAME (and --api-key if the target needs one)",
                          code="model_unknown") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"GET {url} gave no model list ({type(exc).__name__})",
                          hint="check --base-url (or --host/--port), or pass --model NAME",
                          code="model_unknown") from None
    if not models:
        raise ConfigError(f"GET {url} lists no model", hint="pass --model NAME",
                          code="model_unknown")
    if not isinstance(models[0], str) or not models[0]:
        raise ConfigError(f"GET {url} lists a model id that is not a name: "
                          f"{printable(models[0], 80)}", hint="pass --model NAME",
                          code="model_unknown")
    weights = entries[0].get("root") if isinstance(entries[0], dict) else None
    return models[0], weights if isinstance(weights, str) and weights else None


@dataclass
class TargetConfig:
    """Where requests go, and what each carries besides its prompt and media."""

    base_url: str  # the server's root (see server_root)
    endpoint: str = CHAT_ENDPOINT
    model: str | None = None
    api_key: str | None = None
    #: for the cache resets (a target's admin key); None: api_key
    admin_api_key: str | None = None
    #: --header K=V: on every request to the target (load/wire.py checks them)
    headers: dict[str, str] = field(default_factory=dict)
    #: --extra-body: merged into every request's body (none of the fields set here)
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class ArrivalConfig:
    """When requests are sent (and cut), and by how many client processes."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    # vLLM's ramp-up: the rate goes from start to end over the phase's requests (linear or
    # exponential); request_rate is inf then
    ramp_up_strategy: RampUpStrategy | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    #: --request-cancellation-rate (percent of a phase's requests, drawn with the seed) and
    #: --request-cancellation-delay (seconds after sending): the connection is closed then
    cancel_rate: float = 0.0
    cancel_delay_s: float = 0.0
    #: --num-workers: client processes sharing the phase's schedule (load/workers.py)
    num_workers: int = 1


@dataclass
class MediaConfig:
    """How a request's media items are encoded and delivered."""

    media_delivery: MediaDelivery = "data-url"  # or http: the loopback media host
    image_format: str = "JPEG"  # PIL's name: JPEG, PNG or WEBP
    image_quality: int = 90
    video_codec: str = "libx264"
    video_fps: int = 30
    video_gop: int = 30


@dataclass
class LoadConfig:
    """A phase's load: the target, the arrivals and the media, then how answers are read
    and judged. A result's ``config`` holds every field flat (:meth:`flat`), as the flags
    name them."""

    target: TargetConfig
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    seed: int = 0
    timeout_s: float = 300.0  # --request-timeout: one request, from send to its last byte
    max_response_bytes: int = 16 << 20  # --max-response-mb: one answer's bytes at most
    keep_text: bool = False  # keep each answer's text (--tokenizer counts its tokens)
    ttft_from: TtftFrom = "content"  # or chunk (any chunk with choices)
    goodput: dict[str, float] = field(default_factory=dict)
    temperature: float = 0.0
    ignore_eos: bool = True  # every answer as long as asked, so runs compare
    # Stop the phase when the first this-many answers are all the same 4xx (a wrong URL,
    # model or key fails every request alike); 0: never.
    abort_after: int = 5

    def with_arrivals(self, **changes: Any) -> LoadConfig:
        """This load with other arrivals (``request_rate=...``): a point of a sweep, an
        unmeasured warm-up."""
        return replace(self, arrivals=replace(self.arrivals, **changes))

    def flat(self) -> dict[str, Any]:
        """Every field by its own name, the parts' too (deep copies, as ``asdict``)."""
        out: dict[str, Any] = {}
        for name, value in asdict(self).items():
            out.update(value if name in ("target", "arrivals", "media") else {name: value})
        return out


def rendered(spec: MediaSpec, cfg: LoadConfig, cache: dict[MediaSpec, bytes]) -> bytes:
    """The item's encoded bytes in ``cfg``'s formats, rendered once per spec (``cache``)."""
    if spec not in cache:
        cache[spec] = render_media(spec, image_format=cfg.media.image_format,
                                   quality=cfg.media.image_quality, codec=cfg.media.video_codec,
                                   fps=cfg.media.video_fps, gop=cfg.media.video_gop)
    return cache[spec]


def user_message(req: BenchRequest, cfg: LoadConfig, host: MediaHost | None,
                 cache: dict[MediaSpec, bytes]) -> dict[str, Any]:
    """``req`` as one chat user message: its media parts (rendered once per spec, held in
    ``cache``; by URL from ``host`` or inline as data URLs) then its prompt text."""
    parts: list[dict[str, Any]] = []
    for spec in req.media:
        kind = "image_url" if spec.kind == "image" else "video_url"
        parts.append({"type": kind, kind: {"url": media_url(spec, rendered(spec, cfg, cache),
                                                            host)}})
    parts.append({"type": "text", "text": req.prompt})
    return {"role": "user", "content": parts}


def request_body(cfg: LoadConfig, output_len: int, *, messages: list[dict[str, Any]] | None
                 = None, prompt: str = "") -> bytes:
    """The streamed request for ``cfg``'s endpoint: chat ``messages``, or a completion's
    ``prompt``; ``cfg``'s sampling fields, model and --extra-body beside them."""
    body: dict[str, Any] = ({"messages": messages} if messages is not None
                            else {"prompt": prompt})
    body.update({"max_tokens": output_len, "stream": True,
                 "stream_options": {"include_usage": True}, "temperature": cfg.temperature,
                 "ignore_eos": cfg.ignore_eos})
    if cfg.target.model:
        body["model"] = cfg.target.model
    body.update(cfg.target.extra_body)  # load/wire.py: none of its fields is one set here
    return json.dumps(body).encode()


def build_payload(req: BenchRequest, cfg: LoadConfig, host: MediaHost | None,
                  cache: dict[MediaSpec, bytes]) -> tuple[bytes, float]:
    """The request body and the client-side cost of encoding it (base64 + JSON)."""
    for spec in req.media:  # rendered before the clock starts: not the client's encoding
        rendered(spec, cfg, cache)
    start = time.perf_counter()
    if not cfg.target.endpoint.endswith("chat/completions"):  # /v1/completions: a text prompt
        return request_body(cfg, req.output_len, prompt=req.prompt), time.perf_counter() - start
    messages = req.messages if req.messages is not None else [
        user_message(req, cfg, host, cache)]
    encoded = request_body(cfg, req.output_len, messages=messages)
    return encoded, time.perf_counter() - start


async def one_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      body: bytes, record: RequestRecord, cfg: LoadConfig | None = None,
                      cancel: bool = False) -> None:
    """One request under ``cfg``'s bounds (--request-timeout, --max-response-mb): see
    :mod:`aphrodite_cli.bench.load.sse_client` for how every answer is read and judged.
    ``cancel``: cut it ``cfg.arrivals.cancel_delay_s`` after sending (--request-cancellation-*)."""
    cfg = cfg or LoadConfig(target=TargetConfig(base_url=url))
    await sse_client.one_request(session, url, headers, body, record, timeout_s=cfg.timeout_s,
                                 max_bytes=cfg.max_response_bytes, keep_text=cfg.keep_text,
                                 any_chunk=cfg.ttft_from == "chunk",
                                 cancel_after=cfg.arrivals.cancel_delay_s if cancel else None)


class TargetRefused(Exception):
    """The first answers of a phase were all the same client error: the run stops."""

    def __init__(self, records: list[RequestRecord], url: str) -> None:
        super().__init__(url)
        self.records, self.url = records, url


def refused_alike(records: list[RequestRecord]) -> bool:
    """The same client error for all: a wrong URL, model or key. Not 408 or 429 (a slow or
    rate-limiting target is a result to measure, not a mistake in the command)."""
    statuses = {r.status for r in records}
    return len(statuses) == 1 and all(r.status and 400 <= r.status < 500
                                      and r.status not in (408, 429) for r in records)


def arrival_times(n: int, rate: float, burstiness: float, seed: int,
                  ramp: tuple[str, float, float] | None = None) -> list[float]:
    """Seconds after start when each request is sent: all at once for an infinite rate,
    else gamma-distributed gaps (shape = burstiness; 1 is Poisson) with mean 1/rate.
    ``ramp`` (vLLM's --ramp-up-strategy, --ramp-up-start-rps, --ramp-up-end-rps): request i
    of n arrives at its own rate, from start to end as i / (n - 1) goes from 0 to 1, linearly
    (start + (end - start) x progress) or exponentially (start x (end / start) ^ progress)."""
    if ramp is None and math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if ramp is None:
        rates = np.full(n, rate)
    else:
        strategy, start, end = ramp
        progress = np.arange(n) / max(n - 1, 1)
        rates = (start + (end - start) * progress if strategy == "linear"
                 else start * (end / start) ** progress)
    gaps = rng.gamma(shape=burstiness, size=n) / (np.maximum(rates, 1e-9) * burstiness)
    gaps[0] = 0.0  # the first request at once (a linear ramp may start at 0 requests/s)
    return list(np.cumsum(gaps))


def schedule(n: int, cfg: LoadConfig) -> list[float]:
    """``cfg``'s arrival times for n requests (its rate, or its ramp when it has one)."""
    a = cfg.arrivals
    ramp = ((a.ramp_up_strategy, a.ramp_up_start_rps, a.ramp_up_end_rps)
            if a.ramp_up_strategy else None)
    return arrival_times(n, a.request_rate, a.burstiness, cfg.seed, ramp)


async def run_phase(payloads: list[tuple[bytes, float]], cfg: LoadConfig,
                    on_done: Callable[[], None] | None = None,
                    session: aiohttp.ClientSession | None = None,
                    times: list[float] | None = None
                    ) -> tuple[list[RequestRecord], float, float]:
    """Send every payload on the arrival schedule; returns records, duration and the
    achieved send rate."""
    url = server_root(cfg.target.base_url) + cfg.target.endpoint
    headers = request_headers(cfg.target.api_key, cfg.target.headers)
    cut = cancelled_indices(len(payloads), cfg.arrivals.cancel_rate, cfg.seed)
    if times is None:  # else a replayed trace's own (load/trace.py)
        times = schedule(len(payloads), cfg)
    if cfg.arrivals.num_workers > 1 and session is None:  # load/workers.py's run_phase sends these
        raise ValueError("client.run_phase runs one process: call workers.run_phase")
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.arrivals.max_concurrency or 0,
                                           limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s))
    limit = cfg.arrivals.max_concurrency
    slots = asyncio.Semaphore(limit) if limit else None
    records = [RequestRecord(i, encode_s=enc) for i, (_, enc) in enumerate(payloads)]
    sent: list[float] = []

    finished: list[RequestRecord] = []
    refused = asyncio.Event()

    async def run_one(i: int) -> None:
        if slots:
            async with slots:
                if refused.is_set():
                    return
                sent.append(time.perf_counter())
                await one_request(session, url, headers, payloads[i][0], records[i], cfg,
                                  i in cut)
        else:
            sent.append(time.perf_counter())
            await one_request(session, url, headers, payloads[i][0], records[i], cfg, i in cut)
        finished.append(records[i])
        if cfg.abort_after and len(finished) == cfg.abort_after and refused_alike(finished):
            refused.set()
        if on_done:
            on_done()

    start = time.perf_counter()
    tasks = []
    try:
        for i, at in enumerate(times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if refused.is_set():
                break
            tasks.append(asyncio.create_task(run_one(i)))
        waiting = asyncio.ensure_future(asyncio.gather(*tasks))
        watcher = asyncio.ensure_future(refused.wait())
        await asyncio.wait([waiting, watcher], return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if refused.is_set():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            raise TargetRefused(finished[: cfg.abort_after], url)
        await waiting
    finally:
        if own:
            await session.close()
    duration = time.perf_counter() - start
    span = (max(sent) - min(sent)) if len(sent) > 1 else 0.0
    send_rate = (len(sent) - 1) / span if span > 0 else math.inf
    return records, duration, send_rate


def scheduled_rate(n: int, cfg: LoadConfig) -> float:
    """The rate the seeded schedule itself asks for ((n - 1) / last arrival): a Poisson
    schedule of n requests deviates from the nominal rate by about 1/sqrt(n)."""
    times = schedule(n, cfg)
    return (n - 1) / times[-1] if n > 1 and times[-1] > 0 else math.inf


def phase_result(records: list[RequestRecord], duration: float, send_rate: float,
                 cfg: LoadConfig) -> dict[str, Any]:
    metrics = compute(records, duration, cfg.goodput)
    metrics["achieved_send_rate"] = send_rate
    metrics["requested_rate"] = cfg.arrivals.request_rate
    metrics["scheduled_rate"] = scheduled_rate(len(records), cfg)
    return metrics


def document(cfg: LoadConfig, phases: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    config = cfg.flat()
    rate, model = cfg.arrivals.request_rate, cfg.target.model
    config["request_rate"] = "inf" if math.isinf(rate) else rate
    config["model"] = None if model is None else printable(model)  # the target's words
    for secret in ("api_key", "admin_api_key"):  # a secret stays out of result files
        config[secret] = "(set)" if getattr(cfg.target, secret) else None
    # a header may carry a gateway's token: names only, as vLLM redacts --header
    config["headers"] = {printable(name, 80): "(set)" for name in cfg.target.headers}
    for phase in phases.values():
        if math.isinf(phase.get("requested_rate", 0)):
            phase["requested_rate"] = "inf"
        for key in ("achieved_send_rate", "scheduled_rate"):
            if math.isinf(phase.get(key, 0)):
                phase[key] = None
    return {"kind": "serve", "config": config,
            "formulas": FORMULAS, "phases": phases, **extra}
