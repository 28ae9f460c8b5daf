"""The runner's side of prefix caching: a prefilled row's keys and values cut into the
cache's blocks, and a new row's cache filled from them.

A block's value is one tensor ``(2 * layers, kv_heads, block_size, head_dim)``: every layer's
keys, then every layer's values, for those tokens (one allocation per block, freed when the
block is evicted). Only full-attention caches are cut: a sliding-window layer (Gemma 3's local
layers) keeps just the last columns of a prompt, so a prefix's keys are no longer there;
families with one run without prefix caching (:func:`supported`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.executor import kv
from engine.executor.prefix_cache import PrefixCache


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


def fill(cache: Any, blocks: list[Any]) -> None:
    """A fresh one-row ``cache`` holding the keys and values of ``blocks`` (in order)."""
    import torch

    with torch.inference_mode():
        joined = torch.cat(blocks, dim=-2) if len(blocks) > 1 else blocks[0]
        layers = kv._layers(cache)
        count = len(layers)
        for j, layer in enumerate(layers):
            layer.update(joined[j].unsqueeze(0), joined[count + j].unsqueeze(0))


def media_span(input_ids: Sequence[int], media_ids: set[int]) -> tuple[int, int] | None:
    """The first and last media (feature) token of a prompt, or None."""
    at = [i for i, t in enumerate(input_ids) if t in media_ids]
    return (at[0], at[-1]) if at else None


def lookup(store_in: PrefixCache, prompt: Any, media_ids: set[int], *, count: bool
           ) -> tuple[list[bytes], int]:
    """A prompt's block hashes and how many of its first tokens a prefill takes from the
    cache (``count``: the lookup goes into the hit statistics). A prompt with media tokens
    but no content keys (a caller that sent none) is hashed only up to its first media token:
    without the keys two images would look the same."""
    from engine.executor.prefix_cache import usable_prefix

    ids = prompt.input_ids
    span = media_span(ids, media_ids)
    hashed = ids if span is None or prompt.mm_hashes else ids[:span[0]]
    hashes = store_in.hashes(hashed, prompt.mm_hashes if span else (),
                             prompt.mm_positions if span else ())
    length = usable_prefix(store_in.longest(hashes) * store_in.block_size, len(ids), span,
                           store_in.block_size)
    if count:
        store_in.record(len(ids), length)
    return hashes, length
