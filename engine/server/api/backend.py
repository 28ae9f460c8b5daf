"""The engine behind an API server, chosen once from ``--engine`` (:func:`backend_for`): what
differs between this project's engine and vLLM's in one request's steps 7-8. Everything else
in the front end is the same for both, and asks the backend rather than ``--engine``.

- :class:`OursBackend` (``--engine aphrodite``): the HF processor runs here, in the API server;
  the engine gets token ids and processed tensors.
- :class:`VllmBackend` (``--engine vllm``): vLLM runs its own processor, so the items go decoded
  (or left out while vLLM's processor cache holds them, by this server's ledger; see
  :mod:`engine.server.vllm_adapter.vllm_media`).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from engine.media.pool import decode_executor
from engine.processing.preprocess import ProcessedPrompt
from engine.server.api.prepare import decoded_prompt, preprocess_slot, vllm_processor_kwargs
from engine.server.api.protocol import GenerationFields
from engine.server.api.respond import sampling_for_engine
from engine.server.config import ServerConfig
from engine.server.vllm_adapter import vllm_media

if TYPE_CHECKING:
    from engine.server.api.state import State


class OursBackend:
    """``--engine aphrodite``: this project's engine process."""

    name = "aphrodite"

    def ledger(self, config: ServerConfig) -> vllm_media.Ledger:
        """No vLLM processor cache to account for: an empty, disabled ledger."""
        return vllm_media.Ledger.from_gb(0)

    async def process(self, state: State, text: str, items: list, kwargs: dict[str, Any],
                      fields: GenerationFields) -> ProcessedPrompt:
        """Step 7 here: the HF processor (and its cache) off the event loop; its cache hits
        counted at once."""
        processed = await asyncio.get_running_loop().run_in_executor(
            decode_executor(), state.pipeline.process, text, items, kwargs, fields.cache_salt)
        state.metrics.count_items(processed.item_hits)
        return processed

    def generate(self, state: State, fields: GenerationFields, prompts: list[ProcessedPrompt],
                 params: list) -> list:
        """Step 8: one engine request per prompt, one group, so the engine interleaves this
        request's rows with others'."""
        group = uuid.uuid4().hex
        return [state.engine.generate(p.input_ids, p.mm,
                                      sampling_for_engine(sp, fields, vllm=False),
                                      (p.mm_hashes, p.mm_positions), priority=fields.priority,
                                      cache_salt=p.cache_salt, group=group)
                for p, sp in zip(prompts, params, strict=True)]


class VllmBackend:
    """``--engine vllm``: vLLM's engine in the bridge process (its own processor, caches and
    scheduler)."""

    name = "vllm"

    def ledger(self, config: ServerConfig) -> vllm_media.Ledger:
        """The items vLLM's processor cache holds, by this server's account: its share of that
        cache (--mm-processor-cache-gb over --api-server-count)."""
        return vllm_media.Ledger.from_gb(
            config.pipeline.mm_processor_cache_gb / max(config.api_server_count, 1))

    async def process(self, state: State, text: str, items: list, kwargs: dict[str, Any],
                      fields: GenerationFields) -> ProcessedPrompt:
        """Step 7 is vLLM's: the items decoded for its processor (its cache hits are counted
        once it ran, by vllm_media)."""
        return await asyncio.get_running_loop().run_in_executor(
            decode_executor(), decoded_prompt, state, text, items,
            vllm_processor_kwargs(state, fields.mm_processor_kwargs), fields.cache_salt)

    def generate(self, state: State, fields: GenerationFields, prompts: list[ProcessedPrompt],
                 params: list) -> list:
        """Step 8: each prompt through the ledger (resent with its data when vLLM no longer
        holds an item left out)."""
        return [vllm_media.generate(state.engine, state.vllm_ledger, p,
                                    sampling_for_engine(sp, fields, vllm=True),
                                    state.metrics.vllm_media_resent.inc,
                                    lambda: preprocess_slot(state), state.metrics.count_items,
                                    priority=fields.priority)
                for p, sp in zip(prompts, params, strict=True)]


def backend_for(config: ServerConfig) -> OursBackend | VllmBackend:
    """The backend for ``--engine`` (the launcher checked the name before anything started)."""
    return VllmBackend() if config.engine_kind == "vllm" else OursBackend()
