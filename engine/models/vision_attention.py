"""Vision attention over many windows in a few SDPA calls (varlen attention on SDPA).

The Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision encoders attend within spans of their packed
patch sequence: within each image or frame, and (Qwen2.5-VL) within windows of 8 x 8 patches in
most layers. With SDPA, transformers runs one SDPA call per span: a 1280 x 720 image is about
15 windows per layer, a batch of eight requests' media a few hundred, and on the tiny model
those calls' fixed cost was half of the encoder's time. With a flash implementation it instead
hands over the whole packed sequence and the spans' bounds (``cu_seqlens``) in one call.

:func:`attention` takes that one call: spans of one length are gathered into one batch and
attended in one SDPA call (the padding-free way vLLM's varlen vision attention works), then
put back in place. Each span is attended by the same SDPA over the same values as before, so
the encoder's output is that of transformers' own SDPA path (test_vision_attention).

It is registered under :data:`NAME`, which has "flash" in it: that is what makes transformers'
vision attention take the one-call branch. :func:`use` sets it on the configs of a model's
modules that attend by ``cu_seqlens`` (the vision encoders'), never on the text model's.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

#: the name of :func:`attention` among transformers' attention implementations ("flash" in
#: it: see the module's text)
NAME = "aphrodite_flash_varlen_sdpa"


def _bounds(cu: Any, tokens: int) -> list[int]:
    """Span bounds as ints, checked to tile ``tokens`` in order (transformers' own SDPA path
    splits by them and fails otherwise: so does this)."""
    bounds = [int(b) for b in cu.tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != tokens or any(
            b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"span bounds {bounds[:8]}... do not tile {tokens} tokens in order")
    return bounds


def _per_span(module: Any, query: Any, key: Any, value: Any, q_bounds: list[int],
              k_bounds: list[int], **kwargs: Any) -> Any:
    """transformers' SDPA path: one call per span (for what the batched path does not take:
    a mask, several sequences, other bounds for the keys, grouped key/value heads)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = [sdpa_attention_forward(module, query[:, :, qa:qb], key[:, :, ka:kb],
                                   value[:, :, ka:kb], None, **kwargs)[0]
            for (qa, qb), (ka, kb) in zip(itertools.pairwise(q_bounds),
                                          itertools.pairwise(k_bounds), strict=True)]
    return torch.cat(outs, dim=1)


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
              cu_seq_lens_q: Any = None, cu_seq_lens_k: Any = None, **kwargs: Any
              ) -> tuple[Any, None]:
    """transformers' attention interface for packed spans: ``query``, ``key``, ``value``
    ``(1, heads, tokens, dim)``, span ``i`` being tokens ``cu_seq_lens_q[i]`` to
    ``cu_seq_lens_q[i + 1]``; returns ``(1, tokens, heads, dim)``. Without bounds: plain
    SDPA over what it was given."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    bounds = _bounds(cu_seq_lens_q, query.shape[2])
    key_bounds = bounds if cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q else \
        _bounds(cu_seq_lens_k, key.shape[2])
    if query.shape[0] != 1 or attention_mask is not None or len(key_bounds) != len(bounds):
        raise ValueError("packed spans need one sequence, no mask and as many key spans as "
                         "query spans")
    if key_bounds != bounds or key.shape[1] != query.shape[1]:
        return _per_span(module, query, key, value, bounds, key_bounds, dropout=dropout,
                         scaling=scaling, is_causal=is_causal, **kwargs), None
    starts: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    heads, tokens, dim = query.shape[1], query.shape[2], value.shape[-1]
    causal = bool(is_causal)
    out = query.new_empty((heads, tokens, dim))
    for length, firsts in starts.items():
        count = len(firsts)
        contiguous = firsts == list(range(firsts[0], firsts[0] + count * length, length))
        if contiguous:  # a run of spans side by side: views, no gather
            at = slice(firsts[0], firsts[0] + count * length)
            q, k, v = (t[0, :, at].reshape(heads, count, length, -1).transpose(0, 1)
                       for t in (query, key, value))
        else:
            index = (torch.tensor(firsts)[:, None] + torch.arange(length)).reshape(-1).to(
                query.device)
            q, k, v = (t[0].index_select(1, index).view(heads, count, length, -1)
                       .transpose(0, 1) for t in (query, key, value))
        done = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=causal)
        done = done.transpose(0, 1).reshape(heads, count * length, dim)
        if contiguous:
            out[:, at] = done
        else:
            out.index_copy_(1, index, done)
    return out.transpose(0, 1).unsqueeze(0), None


@functools.cache
def register() -> str:
    """Register :func:`attention` with transformers (and SDPA's mask under its name); its
    name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def _attends_by_spans(module: Any) -> bool:
    forward = type(module).forward
    try:
        return "cu_seqlens" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def use(model: Any, text_name: str) -> int:
    """Set :data:`NAME` on the config of every module of ``model`` that attends by
    ``cu_seqlens`` and now runs ``text_name`` (the engine's SDPA); how many configs were
    set."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == text_name \
                and _attends_by_spans(module) and hasattr(module, "num_heads"):
            configs[id(config)] = config
    if configs:
        register()
    for config in configs.values():
        config._attn_implementation = NAME
    return len(configs)
