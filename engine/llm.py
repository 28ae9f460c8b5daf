"""Offline batched inference on the same engine as the server::

    from engine import LLM, SamplingParams
    llm = LLM()                      # the embedded tiny Qwen2.5-VL
    out = llm.generate({"prompt": "Describe it.", "multi_modal_data": {"image": pil_image}})
    print(out[0].outputs[0].text)
    # per generated token {token_id: Logprob(logprob, rank, decoded_token)}, the generated
    # token first, then the k most likely (raw log_softmax of the logits, as vLLM's default)
    out = llm.generate("Hi", SamplingParams(max_tokens=4, logprobs=5))
    print(out[0].outputs[0].logprobs)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import EngineConfig, PipelineConfig
from engine.cpus import in_own_thread, one_torch_thread_pool, usable_cpus
from engine.errors import InvalidRequestError
from engine.executor.engine import Engine
from engine.executor.logits_processors import check_token_ids
from engine.executor.request import CompletionOutput, EngineRequest, checked_priority
from engine.executor.sampling import MAX_TOKENS_CAP, SamplingParams
from engine.models.generation_config import sampling_defaults
from engine.models.loader import load_model
from engine.processing.chat_parts import parse_messages
from engine.processing.pipeline import Pipeline, pipeline_config
from engine.processing.preprocess import MediaItem
from engine.processing.template_kwargs import parse_template_kwargs


@dataclass
class RequestOutput:
    """One prompt's result (vLLM-shaped): ``outputs[i].text``."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict[str, Any] = field(default_factory=dict)
    finished: bool = True
    #: prompt tokens whose keys and values came from the prefix cache (vLLM's name)
    num_cached_tokens: int = 0


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def to_items(mm: dict[str, Any]) -> list[MediaItem]:
    from PIL import Image

    items: list[MediaItem] = []
    for modality, values in mm.items():
        for value in _as_list(values):
            if modality == "image":
                if not isinstance(value, Image.Image):
                    raise InvalidRequestError("multi_modal_data image must be a PIL image",
                                              code="invalid_multi_modal_data")
                items.append(MediaItem("image", decoded=value.convert("RGB")))
            elif modality == "video":
                # (frames, metadata): Hugging Face video_metadata (fps, frames_indices), which
                # families that write timestamps into the prompt (Qwen3-VL) read.
                meta = value[1] if isinstance(value, tuple) and len(value) == 2 and \
                    isinstance(value[1], dict) else None
                frames = np.asarray(value[0] if meta is not None else value)
                if frames.ndim != 4 or frames.shape[-1] != 3:
                    raise InvalidRequestError("multi_modal_data video must be frames shaped "
                                              "(T, H, W, 3), or (frames, metadata dict)",
                                              code="invalid_multi_modal_data")
                items.append(MediaItem("video", decoded=frames.astype(np.uint8, copy=False),
                                       media_kwargs={"metadata": meta} if meta else {},
                                       metadata=dict(meta) if meta else None))
            elif modality == "audio":
                if not (isinstance(value, tuple) and len(value) == 2):
                    raise InvalidRequestError("multi_modal_data audio must be (array, rate)",
                                              code="invalid_multi_modal_data")
                items.append(MediaItem("audio", decoded=(np.asarray(value[0], np.float32),
                                                         int(value[1]))))
            else:
                raise InvalidRequestError(f"unknown multi_modal_data modality {modality!r}",
                                          code="invalid_multi_modal_data")
    return items


class LLM:
    """A model, its processor cache and a batching engine, in this process."""

    def __init__(self, model: str | None = None, *, chat_template: str | None = None,
                 limit_mm_per_prompt: dict[str, int] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None,
                 mm_processor_cache_gb: float = PipelineConfig.mm_processor_cache_gb,
                 media_io_kwargs: dict[str, Any] | None = None,
                 allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None,
                 revision: str | None = None, download_dir: str | None = None,
                 mm_device_do_normalize: bool = PipelineConfig.mm_device_do_normalize,
                 generation_config: str = "auto", **engine_settings: Any) -> None:
        """``engine_settings``: any :class:`~engine.config.EngineConfig` field, e.g.
        ``max_num_seqs=4``, ``max_num_batched_tokens=2048``, ``scheduling="static"``,
        ``device="cuda"``, ``dtype="bfloat16"``, ``num_threads=4``,
        ``enable_prefix_caching=False``, ``prefix_cache_gb=1.0`` (checked there: a bad or
        unknown one is a :class:`~engine.errors.ConfigError`). ``generation_config``
        (vLLM's): "auto" takes the defaults of :meth:`get_default_sampling_params` from the
        model's generation_config.json, "vllm" uses none, or a folder holding one."""
        engine_config = EngineConfig.create(**engine_settings)
        # loaded on a thread that ends with its OpenMP workers (see in_own_thread)
        self.loaded = in_own_thread(load_model, model, chat_template=chat_template,
                                    revision=revision, download_dir=download_dir)
        self.pipeline = Pipeline(self.loaded, pipeline_config(
            limit_mm_per_prompt=limit_mm_per_prompt, mm_processor_kwargs=mm_processor_kwargs,
            mm_processor_cache_gb=mm_processor_cache_gb, media_io_kwargs=media_io_kwargs,
            allowed_media_domains=tuple(allowed_media_domains or ()),
            allowed_local_media_path=allowed_local_media_path,
            mm_device_do_normalize=mm_device_do_normalize))
        self.cache = self.pipeline.cache
        self._defaults = sampling_defaults(generation_config, self.loaded.path)
        self.engine = in_own_thread(Engine, self.loaded, engine_config)
        # prompts are prepared on threads of one torch thread each, as the server's API
        # processes prepare them: they start no OpenMP workers beside the engine's
        self._preparers = one_torch_thread_pool(usable_cpus(), "aphrodite-prep")

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling parameters a call without any gets, the model's
        generation_config.json sampling values over the neutral defaults (its
        ``max_new_tokens`` as ``max_tokens``, at most the engine's cap)."""
        defaults = dict(self._defaults)
        if "max_tokens" in defaults:
            defaults["max_tokens"] = min(defaults["max_tokens"], MAX_TOKENS_CAP)
        return SamplingParams(**defaults)

    def prepare(self, prompt: str, items: list[MediaItem], kwargs: dict[str, Any] | None,
                raw: bool) -> Any:
        return self._preparers.submit(self.pipeline.prepare, prompt, items, kwargs,
                                      raw=raw).result()

    def _run(self, prepared: list[tuple[str, Any]], params: list[SamplingParams],
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        priorities = self._priorities(priority, len(prepared))
        vocab = len(self.loaded.tokenizer)
        for sp in params:  # logit_bias and stop_token_ids name tokens the model has
            check_token_ids(sp, vocab)
        # every constraint compiled (or refused) before any request runs
        grammars = [self.engine.runner.grammars().check(sp.structured_outputs)
                    if sp.structured_outputs is not None else None for sp in params]
        requests = [self.engine.submit(EngineRequest(p, sp, priority=rank, grammar=g))
                    for (_, p), sp, rank, g in zip(prepared, params, priorities, grammars,
                                                   strict=True)]
        results = []
        for (text, processed), req in zip(prepared, requests, strict=True):
            req.done.wait()
            if req.error:
                raise req.error
            self._decode_logprobs(req.outputs)
            metrics = {**processed.timings, **req.timings, "item_cache_hits": processed.item_hits}
            results.append(RequestOutput(req.request_id, text, processed.input_ids, req.outputs,
                                         metrics, num_cached_tokens=req.num_cached_tokens))
        return results

    def _decode_logprobs(self, outputs: list[CompletionOutput]) -> None:
        """``Logprob.decoded_token`` of every reported token (``SamplingParams(logprobs=k)``):
        vLLM's shape, filled here rather than in the engine's step loop."""
        tokenizer = self.loaded.tokenizer
        for out in outputs:
            for entry in out.logprobs or []:
                for token_id, lp in entry.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = tokenizer.decode([token_id])

    def _params(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError("one SamplingParams per prompt, or one for all")
        return params

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int]:
        """vLLM's ``priority`` argument: one per prompt, each an integer, and not 0 only
        with ``scheduling_policy="priority"`` (as vLLM refuses it)."""
        if priority is None:
            return [0] * n
        ranks = list(priority)
        if len(ranks) != n:
            raise InvalidRequestError(f"priority holds {len(ranks)} values for {n} prompts: "
                                      "one per prompt", param="priority")
        for rank in ranks:
            checked_priority(rank, self.engine.config.scheduling_policy)
        return ranks

    def generate(self, prompts: Any, sampling_params: Any = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Prompts: a string, a ``{"prompt", "multi_modal_data", "mm_processor_kwargs"}`` dict,
        or a list of those. Placeholders the prompt lacks are inserted per item.
        ``priority``: vLLM's, one per prompt (lower first, with
        ``scheduling_policy="priority"``)."""
        batch = prompts if isinstance(prompts, list) else [prompts]
        prepared = []
        for entry in batch:
            if isinstance(entry, str):
                entry = {"prompt": entry}
            items = to_items(entry.get("multi_modal_data") or {})
            prepared.append(self.prepare(entry["prompt"], items,
                                          entry.get("mm_processor_kwargs"), raw=True))
        return self._run(prepared, self._params(sampling_params, len(prepared)), priority)

    def chat(self, messages: Sequence[Any], sampling_params: Any = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, with the same
        content parts the server accepts (media URLs are fetched under this LLM's policy);
        ``chat_template_kwargs`` (vLLM's): extra variables for the chat template, under the
        server's rules (:mod:`engine.processing.template_kwargs`)."""
        template_kwargs = parse_template_kwargs(chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prepared = []
        # (the kwargs' fps is the frames per second a video's frames are sampled at)
        video = self.pipeline.video_for(None, self.pipeline.kwargs_for(mm_processor_kwargs))
        for conversation in conversations:
            parsed = parse_messages(list(conversation))
            self.pipeline.check_counts(parsed.counts())
            held = self.pipeline.uuids.held(parsed.refs, None)  # (media uuids: one tenant)
            items = asyncio.run(self._fetch(parsed.media, video)) if parsed.media else []
            items = self.pipeline.place(parsed.refs, items, held, video)
            prepared.append(self.prepare(self.pipeline.render(parsed.messages, None,
                                                               template_kwargs), items,
                                         mm_processor_kwargs, raw=False))
            self.pipeline.uuids.remember(parsed.refs, items, None)
        return self._run(prepared, self._params(sampling_params, len(prepared)))

    async def _fetch(self, media: list[tuple[str, str]], video: Any) -> list[MediaItem]:
        async with self.pipeline.connector() as connector:
            items, _ = await self.pipeline.fetch(connector, media, video)
        return items

    def close(self) -> None:
        self._preparers.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
