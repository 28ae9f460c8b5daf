"""The encoder output cache: a prefill whose media were encoded before skips the encoder.

The model's vision/audio encoder (``ArchSpec.encoder_attr``) is wrapped: while the runner
forwards media it names them (:meth:`EncoderCache.keyed`: the content keys of every item whose
tensors are in the pass, in the order they are concatenated), and each call of the encoder in
that pass is looked up by those keys and its place among the pass's calls (Qwen-VL encodes
images and videos in two calls). The keys cover the items' bytes and processor kwargs, and the
items' order fixes how their tensors are concatenated and padded, so the same keys mean the
same encoder input: its output is returned without running it. The model's own code does the
rest (projector, placement at the placeholder tokens), as on a miss, for every family.

A pass holding other items than before (another image beside it, a different batch) misses:
outputs are kept per pass, not per item. Bounded in bytes, LRU; hits and misses count the
pass's items (what ``/metrics`` shows).
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def nbytes(value: Any) -> int:
    """Bytes of the tensors in an encoder's output (tensors, tuples, lists, dicts, model
    outputs)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def _fresh(value: Any) -> Any:
    """A shallow copy of a cached output's containers (the model may set attributes on a
    model output, e.g. ``pooler_output``); the tensors are shared, never written into."""
    return copy.copy(value) if isinstance(value, (dict, list)) else value


@dataclass
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class EncoderCache:
    """LRU of encoder outputs, at most ``max_bytes``; used on the engine thread only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(int(max_bytes), 0)
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._keys: tuple[str, ...] | None = None
        self._call = 0
        self.stats = EncoderCacheStats()

    def install(self, module: Any) -> None:
        """Wrap ``module.forward`` (an instance attribute: hooks still run around it)."""
        forward = module.forward

        def cached_forward(*args: Any, **kwargs: Any) -> Any:
            keys = self._keys
            if keys is None:
                return forward(*args, **kwargs)
            key = (keys, self._call)
            first = self._call == 0
            self._call += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if first:
                    self.stats.hits += len(keys)
                return _fresh(entry[0])
            if first:
                self.stats.misses += len(keys)
            out = forward(*args, **kwargs)
            self._put(key, out)
            return _fresh(out)

        module.forward = cached_forward

    @contextlib.contextmanager
    def keyed(self, keys: tuple[str, ...] | None) -> Iterator[None]:
        """Encoder calls inside are looked up by ``keys`` (None: not cached)."""
        self._keys, self._call = (keys or None), 0
        try:
            yield
        finally:
            self._keys, self._call = None, 0

    def clear(self) -> int:
        """Drop every entry (``POST /reset_mm_cache``); the hit and miss counts stay. The
        entries dropped."""
        dropped = len(self._entries)
        self._entries.clear()
        self.stats.bytes = self.stats.entries = 0
        return dropped

    def _put(self, key: tuple, value: Any) -> None:
        size = nbytes(value)
        if size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.stats.bytes += size
        while self.stats.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.stats.bytes -= dropped
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)
