"""The running batch's KV cache as rows join and leave between decode steps.

Every row's keys and values sit left-padded to one common length (the padding is masked out by
the batch's attention mask), so a decode step is one forward pass over all rows. Rows that
join are prefilled on their own cache and merged in (the shorter side padded on the left);
rows that leave are dropped by index, and columns that no remaining row uses are cut off.

Sliding-window layers (``DynamicSlidingWindowLayer``: Gemma 3's local layers) keep only the last
``sliding_window - 1`` columns of that common frame, and their ``cumulative_length`` is the
frame's width (transformers sizes their part of the attention mask from it: the mask's last
columns are theirs). Every operation here keeps both true: rows are right-aligned, so a row's
kept columns are the frame's last ones, and its padding is masked by the batch's mask.

Decode steps grow full-attention layers into spare capacity (:func:`reserve`) instead of
concatenating the whole cache per token: on 8 rows of ~600 tokens of the tiny Qwen2.5-VL a
decode step went from 2.8 to 1.7 ms. The room is a quarter of the columns (at least 64).
"""

from __future__ import annotations

import functools
from typing import Any

from engine.errors import ConfigError


def _layers(cache: Any) -> list[Any]:
    layers = list(cache.layers)
    for layer in layers:
        sliding = getattr(layer, "is_sliding", False)
        if not hasattr(layer, "keys") or (sliding and (
                not hasattr(layer, "cumulative_length") or getattr(layer, "record_past", False))):
            raise ConfigError(f"continuous batching needs dynamic full-attention or "
                              f"sliding-window caches; this model has a {type(layer).__name__}",
                              hint="serve a registered family (aphrodite model list)",
                              code="unsupported_cache_layout")
    return layers


def check_supported(config: Any) -> None:
    """At engine start: the model's cache layers are ones this module can merge, select and
    trim (dynamic full-attention or sliding-window layers), else a ConfigError naming the
    layer, instead of every request failing at its first step."""
    from transformers import DynamicCache

    _layers(DynamicCache(config=config))


def _sliding(layer: Any) -> bool:
    return bool(getattr(layer, "is_sliding", False))


def _pad_left(t: Any, width: int) -> Any:
    import torch

    if t.shape[-2] == width:
        return t
    pad = t.new_zeros(*t.shape[:-2], width - t.shape[-2], t.shape[-1])
    return torch.cat([pad, t], dim=-2)


def merge(cache: Any, other: Any) -> Any:
    """``other``'s rows appended after ``cache``'s (in place on ``cache``), both left-padded to
    the longer length (a sliding-window layer: to the longer of the two windows it keeps)."""
    import torch

    for mine, theirs in zip(_layers(cache), _layers(other), strict=True):
        width = max(mine.keys.shape[-2], theirs.keys.shape[-2])
        mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
        mine.values = torch.cat([_pad_left(mine.values, width),
                                 _pad_left(theirs.values, width)])
        if _sliding(mine):
            mine.cumulative_length = max(mine.cumulative_length, theirs.cumulative_length)
    return cache


def select(cache: Any, indices: list[int]) -> None:
    """Keep only these rows (in this order), in place."""
    import torch

    index = torch.tensor(indices, dtype=torch.long)
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))


def take(cache: Any, indices: list[int]) -> Any:
    """A new cache holding a copy of these rows; ``cache`` is left as it was."""
    import copy

    part = copy.copy(cache)
    part.layers = [copy.copy(layer) for layer in _layers(cache)]
    select(part, indices)
    return part


def compact(cache: Any, columns: list[list[int]]) -> None:
    """Row ``i`` keeps its columns ``columns[i]`` (in order), right-aligned and left-padded
    with zeros to the longest row's count, in place: a prefill that wrote each row's new
    tokens after a gap (the cached prefixes left-padded to the longest, the new tokens to
    theirs) leaves each row's tokens side by side again. Full-attention layers only."""
    import torch

    width = max(len(c) for c in columns)
    index = torch.tensor([[0] * (width - len(c)) + c for c in columns], dtype=torch.long)
    keep = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in columns])
    for layer in _layers(cache):
        if _sliding(layer):
            raise ConfigError("prefix-cached rows cannot be compacted in a sliding-window layer",
                              hint="serve this family with --no-enable-prefix-caching",
                              code="unsupported_cache_layout")
        at = index.to(layer.keys.device)[:, None, :, None].expand(
            -1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        zero = keep.to(layer.keys.device, layer.keys.dtype)[:, None, :, None]
        layer.keys = layer.keys.gather(-2, at) * zero
        layer.values = layer.values.gather(-2, at) * zero


def drop_left(cache: Any, columns: int) -> None:
    """Cut the first ``columns`` positions (padding no row attends to), in place."""
    if columns <= 0:
        return
    for layer in _layers(cache):
        if _sliding(layer):
            # the frame narrows; the window keeps at most its new width, from the right
            layer.cumulative_length -= columns
            keep = min(layer.keys.shape[-2], layer.cumulative_length)
            layer.keys = layer.keys[..., layer.keys.shape[-2] - keep:, :]
            layer.values = layer.values[..., layer.values.shape[-2] - keep:, :]
        else:
            layer.keys = layer.keys[..., columns:, :]
            layer.values = layer.values[..., columns:, :]


def _settled(name: str) -> property:
    """A growing layer's ``keys`` or ``values``: in the instance's dict, the views a lazy
    ``grow`` left made first (on reading, and before a new tensor is set)."""

    def get(layer: Any) -> Any:
        layer._settle()
        return layer.__dict__.get(name)

    def put(layer: Any, value: Any) -> None:
        layer._settle()
        layer.__dict__[name] = value

    return property(get, put)


@functools.cache
def _growing_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A full-attention layer whose decode steps write into spare capacity: transformers'
        ``DynamicLayer`` concatenates the whole cache with each step's column (a copy of every
        key and value per token, the largest cost of a decode step at a few hundred tokens);
        this one keeps a buffer with room for more columns and hands out views of its used
        part. Anything else that replaced ``keys``/``values`` (a merge, a row leaving, a
        restore after a failed step) is noticed by identity and copied into a new buffer.

        After :meth:`grow` the views are made when ``keys`` or ``values`` is next read, not
        by ``grow`` itself: the whole-step kernel grows every layer each step and reads none
        of them (two views a layer were ~0.15 ms of a 43 M model's step, on the caches the
        step had just flushed)."""

        keys = _settled("keys")
        values = _settled("values")

        def _settle(self) -> None:
            """Make the views a lazy :meth:`grow` left to make."""
            state = self.__dict__
            lazy = state.get("_lazy")
            if lazy is not None:
                kbuf, vbuf, used = lazy
                state["_lazy"] = None
                keys, values = kbuf.narrow(-2, 0, used), vbuf.narrow(-2, 0, used)
                state["keys"], state["values"] = keys, values
                self._buffers = (kbuf, vbuf, keys, values)

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any
                   ) -> tuple[Any, Any]:
            if not self.is_initialized or self.keys.numel() == 0:
                return super().update(key_states, value_states, *args, **kwargs)
            new = key_states.shape[-2]
            kbuf, vbuf, used = self.room(new)
            kbuf[..., used:used + new, :] = key_states
            vbuf[..., used:used + new, :] = value_states
            self.grow(new)
            return self.keys, self.values

        def room(self, new: int) -> tuple[Any, Any, int]:
            """The buffers with room for ``new`` more columns after the ``used`` ones (the
            keys and values stay as they are until :meth:`grow`): ``(keys, values, used)``.
            (The whole-step kernel writes its column there itself.)"""
            keys, values = self.keys, self.values
            used = keys.shape[-2]
            buffers = getattr(self, "_buffers", None)
            if buffers is None or not self.holds(buffers[0], buffers[1]) or \
                    buffers[0].shape[-2] < used + new:
                room = used + new + max(_SPARE_COLUMNS, (used + new) // 4)
                kbuf = keys.new_empty(*keys.shape[:-2], room, keys.shape[-1])
                vbuf = values.new_empty(*values.shape[:-2], room, values.shape[-1])
                kbuf[..., :used, :] = keys
                vbuf[..., :used, :] = values
                self._buffers = (kbuf, vbuf, keys, values)
            return self._buffers[0], self._buffers[1], used

        def holds(self, kbuf: Any, vbuf: Any) -> bool:
            """Whether the keys and values are still the views of ``kbuf`` and ``vbuf`` that
            the last :meth:`room` or :meth:`grow` left (nothing replaced them since)."""
            lazy = self.__dict__.get("_lazy")
            if lazy is not None:  # (grown, and nothing set since: see the setters)
                return lazy[0] is kbuf and lazy[1] is vbuf
            buffers = getattr(self, "_buffers", None)
            state = self.__dict__
            return buffers is not None and buffers[0] is kbuf and buffers[1] is vbuf and \
                buffers[2] is state.get("keys") and buffers[3] is state.get("values")

        def grow(self, new: int) -> None:
            """The columns written past the keys and values (after :meth:`room`) are theirs
            now (the views made when next read)."""
            lazy = self.__dict__.get("_lazy")
            if lazy is not None:
                self.__dict__["_lazy"] = (lazy[0], lazy[1], lazy[2] + new)
            else:
                buffers = self._buffers
                self.__dict__["_lazy"] = (buffers[0], buffers[1],
                                          self.__dict__["keys"].shape[-2] + new)

    return GrowingLayer


#: the least room a decode buffer keeps beyond its columns (besides a quarter of them)
_SPARE_COLUMNS = 64


def reserve(cache: Any) -> None:
    """Turn ``cache``'s plain full-attention layers into ones that grow into spare capacity
    (:func:`_growing_layer`); the others (sliding windows) are left as they are. Idempotent."""
    from transformers.cache_utils import DynamicLayer

    growing = _growing_layer()
    for layer in _layers(cache):
        if type(layer) is DynamicLayer:
            layer.__class__ = growing


def snapshot(cache: Any) -> list[tuple[Any, Any, int | None]]:
    """What :func:`restore` needs to undo a step: each layer's tensors (a step replaces them,
    never writes into them) and a sliding layer's length."""
    return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None))
            for layer in _layers(cache)]


def restore(cache: Any, state: list[tuple[Any, Any, int | None]]) -> None:
    """Back to a :func:`snapshot`: undoes a step that failed after some layers grew (a
    sliding-window layer may also have dropped its oldest column, which cropping cannot
    bring back)."""
    for layer, (keys, values, length) in zip(_layers(cache), state, strict=True):
        layer.keys, layer.values = keys, values
        if length is not None:
            layer.cumulative_length = length
