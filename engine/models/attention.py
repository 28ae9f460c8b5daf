"""The attention the engine's models run: transformers' SDPA, except a CPU decode step over rows
of very different lengths, which attends each row over its own columns only.

The running batch keeps every row's keys and values left-padded to the longest row
(:mod:`engine.executor.kv`). A decode step reads the whole frame: with two 800-token video
rows beside six 250-token image rows, twice the bytes the rows use, and a CPU decode step is
bound by the bytes it reads (the weights, then the keys and values: on the ~150 M-parameter
Qwen2.5-VL the padding cost about 7 ms of a 45 ms step). Each row's real columns are
contiguous at the frame's right end, so when the padding is at least :data:`MIN_WASTE` of the
frame, each row's one query attends over its slice alone (no mask to apply, no padding read);
otherwise, on a GPU, for prefills and anything unusual (dropout, soft-capping, position
biases, attention sinks, a mask that is not right-aligned) it is transformers' own
``sdpa_attention_forward``.

Registered with transformers as :data:`NAME` (with SDPA's masks) and set on a model that runs
SDPA by :func:`use`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

#: the transformers attention implementation name the engine's models use
NAME = "aphrodite_sdpa"
#: the share of a decode step's key/value frame that must be padding for rows to go apart
MIN_WASTE = 0.25

#: per thread (each engine steps its model on its own thread): the last mask seen and its
#: rows' first columns (a step's layers share one mask)
_last = threading.local()


def _row_starts(mask: Any, kv_len: int) -> list[int] | None:
    """Each row's first attended column when every row attends a contiguous run ending at the
    last column and the padding before them is at least MIN_WASTE of the frame; else None."""
    import torch

    seen = getattr(_last, "seen", None)
    if seen is not None and seen[0] is mask:
        return seen[1]
    starts = None
    m = mask
    if m.dim() == 4 and m.shape[1] == 1 and m.shape[2] == 1 and m.shape[3] == kv_len:
        keep = m[:, 0, 0] if m.dtype == torch.bool else m[:, 0, 0] > torch.finfo(m.dtype).min / 2
        counts = keep.sum(dim=-1)
        first = kv_len - counts
        right_aligned = bool((keep.long().argmax(dim=-1) == first).all()) and bool(
            keep[:, -1].all())
        if right_aligned and int(counts.sum()) <= (1 - MIN_WASTE) * keep.numel():
            starts = first.tolist()
    _last.seen = (mask, starts)
    return starts


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
              **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface: ``query`` ``(batch, heads, q_len, dim)``, ``key``
    and ``value`` ``(batch, kv_heads, kv_len, dim)``; returns ``(batch, q_len, heads, dim)``."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    starts = None
    if query.shape[2] == 1 and query.shape[0] > 1 and attention_mask is not None and \
            not dropout and query.device.type == "cpu" and not any(
            kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux")):
        starts = _row_starts(attention_mask, key.shape[2])
    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    outs = [sdpa_attention_forward(module, query[b:b + 1], key[b:b + 1, :, start:],
                                   value[b:b + 1, :, start:], None, scaling=scaling,
                                   is_causal=False)[0]
            for b, start in enumerate(starts)]
    return torch.cat(outs), None


@functools.cache
def register() -> str:
    """Register :func:`attention` (with SDPA's masks) with transformers; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use(model: Any) -> bool:
    """Run ``model`` (its sub-models too) with :func:`attention` where it runs SDPA now;
    False when it runs something else (eager, flash) or cannot switch."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, ImportError, AttributeError, KeyError):
        return False
    return True
