"""The attention the engine's models run: transformers' SDPA, except a CPU decode step.

A CPU decode step (one query per row, a bool padding mask or none) runs the engine's C kernel
where it is built (:mod:`engine.models.decode_kernels`: each kept key and value read once,
padding never read). Where it is not (no compiler, ``APHRODITE_DECODE_ATTENTION_KERNEL=0``, an
additive mask), rows of very different lengths attend each over their own columns, and other
steps run two batched products, as follows.

The running batch keeps every row's keys and values left-padded to the longest row
(:mod:`engine.executor.kv`). A decode step reads the whole frame: with two 800-token video
rows beside six 250-token image rows, twice the bytes the rows use, and a CPU decode step is
bound by the bytes it reads (the weights, then the keys and values). Each row's real columns
are contiguous at the frame's right end, so when the padding is at least :data:`MIN_WASTE` of
the frame and big enough to cost more than a call per row (:data:`MIN_WASTE_BYTES`), each
row's one query attends over its slice alone (no mask to apply, no padding read: 1.8-2.3x on the
~150 M-parameter model's 12 query heads over 4, ``scripts/attention_bench.py``).

Any other CPU decode step of several rows (the whole frame) is two batched products, each
key/value head's group of query heads against it (:func:`_decode_step`): SDPA's result, 1.6x
faster than its CPU kernel at 8 rows over 300 columns (about 1 ms of a 30 ms decode step of
the 43 M-parameter model). Everything else is transformers' own ``sdpa_attention_forward``:
prefills, a GPU, and anything unusual (dropout, soft-capping, position biases, attention
sinks, a mask of another shape).

Its masks are SDPA's, except a decode step's causal mask: one query at the last position may see
every column, so the mask is the rows' padding mask as it stands (transformers builds it
column by column through its mask functions each step: a seventh of the tiny model's engine
time under load).

Registered with transformers as :data:`NAME` (with :func:`mask`) and set on a model that runs
SDPA by :func:`use`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from engine.models import decode_kernels, vision_attention

#: the transformers attention implementation name the engine's models use
NAME = "aphrodite_sdpa"
#: the share of a decode step's key/value frame that must be padding for rows to go apart
MIN_WASTE = 0.25
#: and the padding's keys and values per layer, in bytes: below it, reading the padding costs
#: less than a call per row (on the tiny model, rows apart were an eighth of a decode step)
MIN_WASTE_BYTES = 2 << 20

#: per thread (each engine steps its model on its own thread): the last mask seen and its
#: rows' first columns (a step's layers share one mask)
_last = threading.local()


def _row_starts(mask: Any, key: Any) -> list[int] | None:
    """Each row's first attended column when every row attends a contiguous run ending at the
    last column and the padding before them is at least MIN_WASTE of the frame and
    MIN_WASTE_BYTES of keys and values; else None. Worked out once per step."""
    import torch

    seen = getattr(_last, "seen", None)
    if seen is not None and seen[0] is mask:
        return seen[1]
    rows, kv_heads, kv_len, dim = key.shape
    column_bytes = 2 * kv_heads * dim * key.element_size()  # keys and values
    starts = None
    if rows * kv_len * column_bytes >= MIN_WASTE_BYTES:  # else even a frame of padding is not
        keep = mask[:, 0, 0] if mask.dtype == torch.bool else \
            mask[:, 0, 0] > torch.finfo(mask.dtype).min / 2
        counts = keep.sum(dim=-1)
        first = kv_len - counts
        right_aligned = bool((keep.long().argmax(dim=-1) == first).all()) and bool(
            keep[:, -1].all())
        padding = keep.numel() - int(counts.sum())
        if right_aligned and padding >= MIN_WASTE * keep.numel() and \
                padding * column_bytes >= MIN_WASTE_BYTES:
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
    rows, _, q_len, dim = query.shape
    plain = not dropout and query.device.type == "cpu" and \
        not any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux"))
    if q_len == 1 and plain and (attention_mask is None or (
            attention_mask.dtype == torch.bool and
            tuple(attention_mask.shape) == (rows, 1, 1, key.shape[2]))):
        keep = None if attention_mask is None else attention_mask[:, 0, 0, :]
        out = decode_kernels.decode_attention(
            query, key, value, keep, dim ** -0.5 if scaling is None else scaling)
        if out is not None:
            return out, None
    if q_len == 1 and rows > 1 and attention_mask is not None and plain and \
            tuple(attention_mask.shape) == (rows, 1, 1, key.shape[2]):
        starts = _row_starts(attention_mask, key)
        if starts is None:
            return _decode_step(query, key, value, attention_mask, scaling), None
    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    outs = [sdpa_attention_forward(module, query[b:b + 1], key[b:b + 1, :, start:],
                                   value[b:b + 1, :, start:], None, scaling=scaling,
                                   is_causal=False)[0]
            for b, start in enumerate(starts)]
    return torch.cat(outs), None


def _decode_step(query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None
                 ) -> Any:
    """One query per row over the whole frame, as two batched products: each key/value
    head's group of query heads is one ``(group, dim) x (dim, columns)`` product, with no
    copy of the shared head. ``(rows, 1, heads, dim)``."""
    import torch

    rows, heads, _, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2))
    scores.mul_(dim ** -0.5 if scaling is None else scaling)
    frame = attention_mask.view(rows, 1, 1, columns)
    if frame.dtype == torch.bool:
        scores.masked_fill_(~frame, float("-inf"))
    else:
        scores.add_(frame)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.reshape(rows, 1, heads, dim)


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
         mask_function: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
    """transformers' mask interface: SDPA's mask, but for one query at or past the last column
    under the plain causal rule the 2D padding mask itself, as (batch, 1, 1, kv_length)."""
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    # (on a CPU only: elsewhere SDPA's own may be None, which lets a GPU use its flash kernel)
    if (q_length == 1 and mask_function is causal_mask_function and attention_mask is not None
            and attention_mask.dim() == 2 and attention_mask.device.type == "cpu"
            and int(q_offset) >= kv_offset + kv_length - 1):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        return padding[:, None, None, kv_offset:kv_offset + kv_length]
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, **kwargs)


@functools.cache
def register() -> str:
    """Register :func:`attention` (with :func:`mask`) with transformers; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
    return NAME


def use(model: Any) -> bool:
    """Run ``model`` (its sub-models too) with :func:`attention` where it runs SDPA now, and
    its vision encoders' span attention with :mod:`engine.models.vision_attention`; False when
    it runs something else (eager, flash) or cannot switch."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, ImportError, AttributeError, KeyError):
        return False
    vision_attention.use(model, NAME)  # the vision encoders' spans: a few calls, not one each
    if next(model.parameters()).device.type == "cpu":
        decode_kernels.prepare()  # (built or loaded now, never in a request)
    return True
