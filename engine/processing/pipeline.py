"""One request pipeline: a prompt and its media -> the engine's inputs.

Built once per process from a :class:`~engine.config.PipelineConfig` (resolved where the
settings enter, by :func:`pipeline_config`: the ``serve`` flags, ``LLM(...)``'s arguments)
and the loaded model, and used
by the API server, the offline ``LLM``, ``bench mm-processor`` and the server's start-up
check, so every one of them limits, checks, fetches, decodes and preprocesses the same way.
Its stages, in request order, are public
methods so callers can time them or put their own work between them (the server takes a
fetch slot and a decode-queue place around :meth:`Pipeline.fetch`):

  :meth:`check_counts` items per modality (400, before anything is fetched)
  :meth:`kwargs_for` / :meth:`video_for` the request's processor and video options merged
      over the server's (checked; per-request overrides through ``dataclasses.replace``)
  :meth:`render` / :meth:`raw_prompt` the prompt text with one placeholder per item
  :meth:`check_sources` the media policy, once per reference (redirect hops re-check it)
  :meth:`fetch` the bytes, concurrently, into items that decode lazily
  :meth:`place` those and the items named by a uuid alone (``uuids``, looked up before the
      fetch: :mod:`engine.processing.media_uuids`), in prompt order
  :meth:`process` cache lookup, decode, HF processor, assembly (each stage timed)
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from engine.config import MediaLimits, MediaPolicy, PipelineConfig, RequestKwargs
from engine.errors import ConfigError, InvalidRequestError
from engine.media.video.options import (
    VideoLoadSpec,
    parse_video_io_kwargs,
    server_video_spec,
)
from engine.processing import device_normalize
from engine.processing.cache import ProcessorCache
from engine.processing.kwargs import check_request_kwargs, merge_processor_kwargs
from engine.processing.limits import check_item_counts, check_limit_flag, effective_limits
from engine.processing.media_items import fetch_items, item_for
from engine.processing.media_uuids import MediaUuids
from engine.processing.preprocess import MediaItem, Preprocessor, ProcessedPrompt
from engine.processing.prompt import insert_placeholders, render_chat

if TYPE_CHECKING:
    from engine.media.connector import MediaConnector
    from engine.media.inflight import Ticket
    from engine.media.policy import MediaSource
    from engine.models.loader import LoadedModel
    from engine.processing.chat_parts import MediaRef


def pipeline_config(*, allowed_media_domains: tuple[str, ...] | list[str] | None = None,
                    allowed_local_media_path: str | os.PathLike[str] | None = None,
                    media_io_kwargs: dict[str, Any] | None = None,
                    limit_mm_per_prompt: dict[str, int] | None = None,
                    mm_processor_kwargs: dict[str, Any] | None = None,
                    mm_processor_cache_gb: float = PipelineConfig.mm_processor_cache_gb,
                    mm_uuid_cache_gb: float = PipelineConfig.mm_uuid_cache_gb,
                    request_kwargs: RequestKwargs = "any",
                    mm_device_do_normalize: bool = PipelineConfig.mm_device_do_normalize
                    ) -> PipelineConfig:
    """A :class:`PipelineConfig` from the flags' values, each checked once here; a bad one is
    a :class:`ConfigError` naming its flag."""
    check_limit_flag(limit_mm_per_prompt)
    if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
        raise ConfigError("--mm-processor-kwargs must be a JSON object", code="invalid_flag")
    return PipelineConfig(policy=MediaPolicy.create(allowed_domains=allowed_media_domains,
                                                    allowed_local_path=allowed_local_media_path),
                          video=server_video_spec(media_io_kwargs),
                          limit_mm_per_prompt=limit_mm_per_prompt,
                          mm_processor_kwargs=mm_processor_kwargs,
                          mm_processor_cache_gb=mm_processor_cache_gb,
                          mm_uuid_cache_gb=mm_uuid_cache_gb,
                          request_kwargs=request_kwargs,
                          mm_device_do_normalize=mm_device_do_normalize)

class Pipeline:
    """The model's request pipeline; building it checks what needs the model (item limits
    against the family's, processor kwargs against its processor: a
    :class:`~engine.errors.ConfigError` naming the flag)."""

    def __init__(self, loaded: LoadedModel, config: PipelineConfig | None = None) -> None:
        config = config or PipelineConfig()
        self.loaded = loaded
        self.config = config
        self.limits = effective_limits(loaded.spec, config.limit_mm_per_prompt)
        try:
            self.server_kwargs = merge_processor_kwargs(loaded.processor,
                                                        config.mm_processor_kwargs, None)
        except InvalidRequestError as exc:  # the operator's setting, not a client's request
            raise ConfigError(f"mm_processor_kwargs (--mm-processor-kwargs): {exc.message}",
                              hint=f"{exc.hint}; `aphrodite model list` names each family's "
                                   "own", code="invalid_mm_processor_kwargs") from None
        #: pixels left uint8 for the engine to normalize on the model's device
        self.device_normalize = config.mm_device_do_normalize and bool(
            loaded.spec.normalize_on_device)
        if self.device_normalize:
            self.server_kwargs = {**self.server_kwargs, **device_normalize.processor_kwargs()}
        self.video = config.video if config.video is not None else server_video_spec(None)
        self.policy = config.policy
        self.media_limits = MediaLimits.from_env()
        self.cache = ProcessorCache.from_gb(config.mm_processor_cache_gb)
        self.preprocessor = Preprocessor(loaded, self.cache)
        #: clients' media uuids -> the content they named, per tenant
        self.uuids = MediaUuids.from_gb(config.mm_uuid_cache_gb)
        extractor = getattr(loaded.processor, "feature_extractor", None)
        #: the rate audio is decoded to: the model's feature extractor's
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16_000))

    # -- before any fetch ------------------------------------------------------------------
    def check_counts(self, counts: Counter[str] | dict[str, int]) -> None:
        check_item_counts(counts, self.limits, self.loaded.spec, self.config.limit_mm_per_prompt)

    def kwargs_for(self, request: dict[str, Any] | None) -> dict[str, Any]:
        """The processor kwargs of one request: the server's, with the request's on top."""
        if self.config.request_kwargs == "bounded":
            check_request_kwargs(self.loaded.processor, self.server_kwargs, request)
        merged = merge_processor_kwargs(self.loaded.processor, self.server_kwargs, request)
        if self.device_normalize:
            # the engine normalizes: a request's own setting would normalize twice or not at
            # all (vLLM ignores it too)
            merged.update(device_normalize.processor_kwargs())
        return merged

    def video_for(self, media_io_kwargs: dict[str, Any] | None,
                  processor_kwargs: dict[str, Any] | None = None) -> VideoLoadSpec:
        """The video options of one request: the server's, with the request's on top. The
        processor kwargs' ``fps`` (``processor_kwargs``, from :meth:`kwargs_for`: frames per
        second to sample, Hugging Face's meaning) sets the frame sampler's: the engine samples
        the frames and hands the processor those alone (``do_sample_frames`` off), so an
        ``fps`` left to the processor would change nothing. The request's own
        ``media_io_kwargs.video.fps`` wins over it."""
        video = (media_io_kwargs or {}).get("video")
        spec = parse_video_io_kwargs(video, self.video)
        fps = (processor_kwargs or {}).get("fps")
        if fps is None or (isinstance(video, dict) and "fps" in video):
            return spec
        return dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, fps=fps))

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """A chat's prompt text (the model's template, given the request's ``tools`` and
        checked ``chat_template_kwargs``), one placeholder per media part."""
        return render_chat(self.loaded, messages, tools, template_kwargs)

    def raw_prompt(self, prompt: str, counts: Counter[str] | dict[str, int]) -> str:
        """A raw prompt with a placeholder for each item it lacks one for."""
        return insert_placeholders(prompt, self.loaded.spec, counts)

    # -- media -----------------------------------------------------------------------------
    def connector(self) -> MediaConnector:
        """A connector under this pipeline's policy and limits (close it when done)."""
        from engine.media.connector import MediaConnector

        return MediaConnector(self.policy, self.media_limits)

    async def check_sources(self, connector: MediaConnector,
                            media: list[tuple[str, str]]) -> list[MediaSource]:
        """Every reference against the policy, before anything is fetched."""
        return await connector.check_all([(url, modality) for modality, url in media])

    async def fetch(self, connector: MediaConnector, media: list[tuple[str, str]],
                    video: VideoLoadSpec, *, sources: list[MediaSource] | None = None,
                    decoders: Any = None, ticket: Ticket | None = None,
                    started: float | None = None) -> tuple[list[MediaItem], float]:
        """The media of one request as items (decoded on a cache miss only), and the
        seconds the fetch took; ``sources`` from :meth:`check_sources` (else checked here)."""
        return await fetch_items(connector, media, video, self.sampling_rate, decoders,
                                 ticket, sources, started)

    def place(self, refs: list[MediaRef], fetched: list[MediaItem],
              held: list[tuple[str, bytes] | None], video: VideoLoadSpec,
              decoders: Any = None) -> list[MediaItem]:
        """A request's items in prompt order: ``fetched`` (the parts with media, in order) and,
        for each part named by its uuid alone, an item rebuilt from the bytes ``held`` for it
        (``self.uuids.held``), decoding as a fetched one does, so its keys are the same."""
        rest = iter(fetched)
        return [next(rest) if one is None else item_for(
            one[0], one[1], self.media_limits, video, self.sampling_rate, decoders)
            for _, one in zip(refs, held, strict=True)]

    # -- preprocessing ---------------------------------------------------------------------
    def process(self, text: str, items: list[MediaItem], kwargs: dict[str, Any] | None = None,
                salt: str | None = None) -> ProcessedPrompt:
        """Cache lookup, decode and HF processor per item, then assembly; ``timings`` holds
        each stage's seconds (hash_s, cache_lookup_s, media_decode_s, processor_s);
        ``salt``: the request's ``cache_salt``."""
        return self.preprocessor.process(text, items, kwargs or {}, salt)

    def prepare(self, prompt: str, items: list[MediaItem], kwargs: dict[str, Any] | None = None,
                *, raw: bool = False) -> tuple[str, ProcessedPrompt]:
        """Decoded or fetched items and their prompt -> (prompt text, engine inputs): the
        whole pipeline after the fetch, for callers that hold their media already."""
        counts = Counter(i.modality for i in items)
        self.check_counts(counts)
        if raw:
            prompt = self.raw_prompt(prompt, counts)
        return prompt, self.process(prompt, items, self.kwargs_for(kwargs))
