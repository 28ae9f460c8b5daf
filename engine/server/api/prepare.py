"""An API server's steps 2-7 (CONTRIBUTING.md's "One request, as folders"): a chat's parts,
limits, media policy, fetch (under a fetch slot), decode (GPU videos under this process's
budget share) and the HF processor, or a completion's prompts; everything before the engine,
raising before any response byte. The stages themselves are the
:class:`~engine.processing.pipeline.Pipeline`'s; this adds what one API server shares among its
requests: fetch slots, the decode-queue bound, the GPU decode budget, metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from engine.errors import ClientError, InvalidRequestError, OverloadedError
from engine.media.decode_errors import name_item
from engine.media.inflight import Ticket
from engine.media.pool import decode_executor
from engine.media.video import load_video_async
from engine.media.video.backend_info import BACKENDS
from engine.processing.chat_parts import parse_messages
from engine.processing.media_items import use_frames
from engine.processing.preprocess import ProcessedPrompt
from engine.server.api.protocol import GenerationFields, parse_generation_fields, parse_prompts
from engine.server.api.tenants import effective_salt
from engine.server.vllm_adapter import vllm_inputs, vllm_media
from engine.timings import zero_preprocess_timings

if TYPE_CHECKING:
    from engine.server.api.state import State


async def prepare_chat(state: State, data: dict[str, Any], ticket: Ticket, client: str = "",
                       key_salt: str | None = None) -> tuple[GenerationFields, ProcessedPrompt]:
    """A chat's fields (step 1) and steps 2-7: everything before the engine; raises before
    any response byte. Fetched media is charged to ``ticket`` (the request's share of the
    bytes in flight); ``client`` (the peer address) bounds its share of the fetch slots;
    ``key_salt``: its API key's salt (``--cache-salt-per-api-key``), under its cache_salt."""
    config = state.config
    fields = parse_generation_fields(data, max_tokens_cap=config.max_tokens_cap,
                                     scheduling_policy=config.engine.scheduling_policy,
                                     tool_parser=config.tool_call_parser
                                     if config.enable_auto_tool_choice else None,
                                     vocab_size=state.vocab_size,
                                     defaults=config.sampling_defaults)
    fields.cache_salt = effective_salt(fields.cache_salt, key_salt)
    parsed = parse_messages(data.get("messages"))
    await check_constraint(state, fields)
    counts = Counter(parsed.counts())
    pipeline = state.pipeline
    pipeline.check_counts(counts)
    kwargs = pipeline.kwargs_for(fields.mm_processor_kwargs)
    video = pipeline.video_for(fields.media_io_kwargs, kwargs)  # (kwargs' fps samples frames)
    # in the template whatever tool_choice says, "none" too (vLLM's default): the prompt, and
    # its token count, does not depend on whether a call is wanted
    tools = data.get("tools") or None
    text = await asyncio.get_running_loop().run_in_executor(  # templating: off the loop
        decode_executor(), pipeline.render, parsed.messages, tools,
        fields.chat_template_kwargs)
    items, fetch_s = [], 0.0
    # Only requests with media take a decode-queue slot: text never waits behind video.
    with preprocess_slot(state) if parsed.refs else contextlib.nullcontext():
        if parsed.refs:  # (a uuid naming nothing is a 400 before any byte is fetched)
            held = pipeline.uuids.held(parsed.refs, fields.cache_salt)
            decoders = state.decoders.for_client(client)
            if parsed.media:
                sources = await pipeline.check_sources(state.connector, parsed.media)
                started = asyncio.get_running_loop().time()  # fetch deadlines: queueing too
                async with fetch_slot(state, sources, started, client):
                    items, fetch_s = await pipeline.fetch(
                        state.connector, parsed.media, video, sources=sources,
                        decoders=decoders, ticket=ticket, started=started)
                for item in items:
                    state.metrics.media_bytes.labels(item.modality).inc(
                        len(item.encoded or b""))
            items = pipeline.place(parsed.refs, items, held, video, decoders)
            if state.gpu_budget is not None and BACKENDS[video.backend].gpu:
                await decode_gpu_videos(state, items, video)
        processed = await state.backend.process(state, text, items, kwargs, fields)
    pipeline.uuids.remember(parsed.refs, items, fields.cache_salt)  # (once it processed)
    processed.timings["fetch_s"] = fetch_s
    if counts.get("video") and processed.timings["media_decode_s"]:
        state.metrics.video_decode.labels(video.backend).observe(
            processed.timings["media_decode_s"])
    return fields, processed


async def check_constraint(state: State, fields: GenerationFields) -> None:
    """A structured-output constraint compiled (or found compiled) before the request goes
    any further, off the event loop and within the compile deadline: one that does not
    compile, or not in time, is a 400 naming its field (see :mod:`engine.executor.grammar`).
    The engine compiles it again for its own use (cached there too)."""
    spec = fields.sampling.structured_outputs
    if spec is None:
        return
    grammars = await asyncio.get_running_loop().run_in_executor(None, state.grammars)
    await grammars.check_async(spec)


def vllm_processor_kwargs(state: State, request: dict[str, Any] | None
                          ) -> dict[str, Any] | None:
    """The processor kwargs vLLM's processor gets for one request: the server's
    (--mm-processor-kwargs) with the request's on top, the request's bounded as ours are
    (its own processor checks the values)."""
    merged = {**(state.config.pipeline.mm_processor_kwargs or {}), **(request or {})}
    return merged or None


def decoded_prompt(state: State, text: str, items: list, kwargs: dict[str, Any] | None,
                   salt: str | None = None) -> ProcessedPrompt:
    """``--engine vllm``: the prompt text and its items decoded (under the same decode
    workers, budgets and caps as ours), for vLLM's own processor; ``input_ids`` holds the
    text's tokens (placeholders not expanded) for the length checks before the engine,
    which reports the real prompt back. Each item is named by its content key, and one that
    vLLM holds by the ledger's account is left out, undecoded (``item_hits``; see
    :mod:`engine.server.vllm_adapter.vllm_media`). ``salt``: the request's cache salt, for vLLM's
    prefix
    cache and in every item's name."""
    timings = zero_preprocess_timings()
    start = time.perf_counter()
    names = [vllm_media.item_uuid(state.name, item, kwargs, salt) for item in items]
    timings["hash_s"] = time.perf_counter() - start
    ledger = state.vllm_ledger
    hits = [ledger.enabled and name is not None and item.decoded is None and ledger.holds(name)
            for item, name in zip(items, names, strict=True)]
    mm, sent = _decode_for_vllm(items, names, hits)
    timings["media_decode_s"] = time.perf_counter() - start - timings["hash_s"]
    ids = state.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = ProcessedPrompt(list(ids), mm, hits, timings,
                             dict(Counter(i.modality for i in items)), text=text,
                             processor_kwargs=kwargs, mm_hashes=[n or "" for n in names],
                             mm_sent=sent, cache_salt=salt)
    if any(hits):
        prompt.refill = lambda: _decode_for_vllm(items, names, [False] * len(items))
    return prompt


def _decode_for_vllm(items: list, names: list[str | None], left_out: list[bool]
                     ) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """The items packed for the bridge, decoded unless ``left_out``; and the content keys and
    estimated processed bytes of those sent with data (for the ledger)."""
    packed, sent = [], []
    for index, (item, name, skip) in enumerate(zip(items, names, left_out, strict=True)):
        data = None
        if not skip:
            try:
                data = item.decoded if item.decoded is not None else (
                    item.decode_pixels or item.decode)()
            except ClientError as err:
                raise name_item(err, index, item.modality) from None
            if name is not None:
                sent.append((name, vllm_media.estimate(item.modality, data)))
        packed.append((item.modality, data, item.metadata, name))
    return vllm_inputs.pack(packed), sent


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


async def prepare_prompts(state: State, data: dict[str, Any], key_salt: str | None = None
                          ) -> tuple[GenerationFields, list[ProcessedPrompt]]:
    """A text completion's ``prompt`` (a string, a list of strings, a list of token ids or a
    list of lists of token ids), each tokenized (off the event loop) or taken as it is;
    ``key_salt`` as for :func:`prepare_chat`."""
    fields = parse_generation_fields(data, max_tokens_cap=state.config.max_tokens_cap,
                                     chat=False,
                                     scheduling_policy=state.config.engine.scheduling_policy,
                                     vocab_size=state.vocab_size,
                                     defaults=state.config.sampling_defaults)
    fields.cache_salt = effective_salt(fields.cache_salt, key_salt)
    await check_constraint(state, fields)
    prompts = parse_prompts(data.get("prompt"), state.vocab_size,
                            set(state.preprocessor.expansion_ids.values())
                            | set(state.preprocessor.feature_ids.values()))
    loop = asyncio.get_running_loop()
    processed = []
    for prompt in prompts:
        if isinstance(prompt, str):
            one = await loop.run_in_executor(decode_executor(), state.pipeline.process,
                                             prompt, [], None, fields.cache_salt)
        else:
            one = ProcessedPrompt(prompt, {}, [], zero_preprocess_timings(), {},
                                  cache_salt=fields.cache_salt)
        if not one.input_ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", param="prompt")
        one.timings["fetch_s"] = 0.0
        processed.append(one)
    return fields, processed
