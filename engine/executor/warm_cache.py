"""The runner's warm caches: prefix blocks (:mod:`engine.executor.prefix_cache`) cut from a
prefilled row's keys and values and filled into a new row's cache, and the encoder output
cache (:mod:`engine.executor.encoder_cache`) named by the items of a forward pass.

A block's value is one tensor ``(2 * layers, kv_heads, block_size, head_dim)``: every layer's
keys, then every layer's values, for those tokens (one allocation per block, freed when the
block is evicted). Only full-attention caches are cut: a sliding-window layer (Gemma 3's local
layers) keeps just the last columns of a prompt, so a prefix's keys are no longer there;
families with one run without prefix caching (:func:`supported`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.executor import kv
from engine.executor.encoder_cache import EncoderCache
from engine.executor.prefix_cache import PrefixCache, usable_prefix

#: prompts whose block hashes are kept (a few batches' worth of waiting requests)
_KEYS_KEPT = 256


def supported(config: Any) -> bool:
    """Whether this model's cache layers can be cut into prefix blocks (no sliding window)."""
    from transformers import DynamicCache

    return not any(getattr(layer, "is_sliding", False)
                   for layer in kv._layers(DynamicCache(config=config)))


def store(store_in: PrefixCache, cache: Any, row: int, start: int, hashes: Sequence[bytes]
          ) -> None:
    """Put the blocks of ``hashes`` that ``store_in`` lacks, taken from row ``row`` of
    ``cache`` whose prompt starts at column ``start`` (left padding before it)."""
    import torch

    missing = store_in.missing(hashes)
    if not missing:
        return
    size = store_in.block_size
    first, end = missing[0], missing[-1] + 1
    layers = kv._layers(cache)
    if len({(layer.keys.shape[1], layer.keys.shape[-1]) for layer in layers}) > 1:
        return  # layers of different shapes: not stacked into blocks (none such registered)
    span = slice(start + first * size, start + end * size)
    with torch.inference_mode():
        stacked = torch.stack([layer.keys[row, :, span] for layer in layers]
                              + [layer.values[row, :, span] for layer in layers])
        blocks = stacked.split(size, dim=-2)
        values = {}
        for i in missing:
            block = blocks[i - first].clone()
            values[i] = (block, block.numel() * block.element_size())
    store_in.put(hashes, values)


def media_span(input_ids: Sequence[int], media_ids: set[int]) -> tuple[int, int] | None:
    """The first and last media (feature) token of a prompt, or None."""
    at = [i for i, t in enumerate(input_ids) if t in media_ids]
    return (at[0], at[-1]) if at else None


#: a prompt's block hashes and its media span (first and last media token, or None)
PromptKeys = tuple[list[bytes], tuple[int, int] | None]


def prompt_keys(store_in: PrefixCache, prompt: Any, media_ids: set[int]) -> PromptKeys:
    """A prompt's block hashes and its media span (:func:`media_span`). A prompt with media
    tokens but no content keys (a caller that sent none) is hashed only up to its first media
    token: without the keys two images would look the same."""
    ids = prompt.input_ids
    span = media_span(ids, media_ids)
    hashed = ids if span is None or prompt.mm_hashes else ids[:span[0]]
    return store_in.hashes(hashed, prompt.mm_hashes if span else (),
                           prompt.mm_positions if span else (),
                           getattr(prompt, "cache_salt", None)), span


def lookup(store_in: PrefixCache, length: int, keys: PromptKeys, *, count: bool,
           inside_media: bool = False) -> int:
    """How many of the first tokens of a prompt of ``length`` tokens with ``keys``
    (:func:`prompt_keys`) a prefill takes from the cache (``count``: the lookup goes into the
    hit statistics; ``inside_media``: the prefix may end inside the media span, see
    :func:`usable_prefix`)."""
    hashes, span = keys
    usable = usable_prefix(store_in.longest(hashes) * store_in.block_size, length, span,
                           store_in.block_size, inside_media=inside_media)
    if count:
        store_in.record(length, usable)
    return usable


class WarmCaches:
    """A runner's prefix cache (None when off, or for a family whose cache layers cannot be
    cut into blocks: sliding windows, Gemma 3) and encoder output cache (None when its bound
    is 0 or the model has no encoder). ``inside_media``: a cached prefix may end inside a
    prompt's media span (the runner resumes there from the merged embeddings)."""

    def __init__(self, model: Any, encoder: Any, media_token_ids: set[int],
                 config: EngineConfig, inside_media: bool = False) -> None:
        self.media_token_ids = media_token_ids
        self.inside_media = inside_media
        self.prefix = PrefixCache(config.prefix_cache_bytes, config.block_size) if (
            config.enable_prefix_caching and config.prefix_cache_bytes > 0
            and supported(model.config)) else None
        self.encoder = EncoderCache(config.encoder_cache_bytes) if (
            encoder is not None and config.encoder_cache_bytes > 0) else None
        if self.encoder is not None:
            self.encoder.install(encoder)
        #: the block hashes and media spans of recent prompts (by identity, held weakly: a
        #: finished prompt's tensors are not kept), see :meth:`_prompt_keys`
        self._keys: OrderedDict[int, tuple[weakref.ref, PromptKeys]] = OrderedDict()

    def stats(self) -> dict[str, float]:
        """Counters for /metrics: tokens queried and hit, blocks and bytes held; encoder
        items hit and missed, bytes held."""
        out: dict[str, float] = {}
        if self.prefix is not None:
            st = self.prefix.stats
            out.update(prefix_cache_queries=st.queries, prefix_cache_hits=st.hits,
                       prefix_cache_blocks=st.blocks, prefix_cache_bytes=st.bytes,
                       prefix_cache_capacity_bytes=self.prefix.max_bytes)
        if self.encoder is not None:
            enc = self.encoder.stats
            out.update(encoder_cache_hits=enc.hits, encoder_cache_misses=enc.misses,
                       encoder_cache_bytes=enc.bytes)
        return out

    def lookup(self, request: Any, first_row: bool) -> tuple[list[bytes], int]:
        """A row's prompt's block hashes and its cached prefix length (0 without a prefix
        cache); a request's first row counts the lookup and reports its cached tokens."""
        if self.prefix is None:
            return [], 0
        keys = self._prompt_keys(request.prompt)
        length = lookup(self.prefix, len(request.prompt.input_ids), keys, count=first_row,
                        inside_media=self.inside_media)
        if first_row:
            request.num_cached_tokens = length
        return keys[0], length

    def cached_tokens(self, prompt: Any) -> int:
        """How many of ``prompt``'s first tokens a prefill now takes from the prefix cache
        (0 without one); not counted in the statistics."""
        if self.prefix is None:
            return 0
        return lookup(self.prefix, len(prompt.input_ids), self._prompt_keys(prompt),
                      count=False, inside_media=self.inside_media)

    def _prompt_keys(self, prompt: Any) -> PromptKeys:
        """:func:`prompt_keys` of ``prompt``, kept for the next lookup: the scheduler asks
        for a waiting prompt's cached length at every step it looks at it (under
        ``--scheduling-policy shortest``, every waiting prompt's), which then costs a lookup
        in the cache, not a scan of the prompt."""
        found = self._keys.get(id(prompt))
        if found is not None and found[0]() is prompt:
            self._keys.move_to_end(id(prompt))
            return found[1]
        keys = prompt_keys(self.prefix, prompt, self.media_token_ids)
        self._keys[id(prompt)] = (weakref.ref(prompt), keys)
        while len(self._keys) > _KEYS_KEPT:
            self._keys.popitem(last=False)
        return keys

    def store(self, cache: Any, row: int, start: int, hashes: Sequence[bytes]) -> None:
        if self.prefix is not None:
            store(self.prefix, cache, row, start, hashes)

    def fill_rows(self, cache: Any, hashes: Sequence[Sequence[bytes]], cached: Sequence[int]
                  ) -> None:
        """A fresh ``cache`` holding, for row ``i``, the keys and values of its first
        ``cached[i]`` tokens, left-padded with zeros to the longest (nothing when none is
        cached)."""
        import torch

        prefix = max(cached, default=0)
        if not prefix or self.prefix is None:
            return
        size = self.prefix.block_size
        rows = [self.prefix.get(h[:c // size]) if c else [] for h, c in zip(
            hashes, cached, strict=True)]
        sample = next(blocks[0] for blocks in rows if blocks)
        with torch.inference_mode():
            stacked = sample.new_zeros((sample.shape[0], len(rows), sample.shape[1], prefix,
                                        sample.shape[-1]))
            for i, (blocks, c) in enumerate(zip(rows, cached, strict=True)):
                if blocks:
                    stacked[:, i, :, prefix - c:] = torch.cat(blocks, dim=-2)
            layers = kv._layers(cache)
            count = len(layers)
            for j, layer in enumerate(layers):
                layer.update(stacked[j], stacked[count + j])

    def keyed(self, prompts: list[Any]) -> Any:
        """The encoder cache's lookups in a forward pass over ``prompts``, named by their
        items' content keys in the order their tensors are concatenated (nothing cached
        when a prompt with media tokens came without keys)."""
        if self.encoder is None:
            return contextlib.nullcontext()
        keys: list[str] = []
        for prompt in prompts:
            if not prompt.mm_hashes and media_span(prompt.input_ids, self.media_token_ids):
                return contextlib.nullcontext()
            keys += prompt.mm_hashes
        return self.encoder.keyed(tuple(keys))
