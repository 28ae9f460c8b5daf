"""The processor cache: processed items (tensors) keyed by a hash of the item's encoded bytes
plus everything that changes the processed result; LRU, bounded in bytes."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


def item_key(model: str, modality: str, content_hash: str, processor_kwargs: dict[str, Any],
             media_kwargs: dict[str, Any]) -> str:
    """The cache key: model, modality, content and every setting that changes the result."""
    settings = json.dumps({"model": model, "modality": modality, "proc": processor_kwargs,
                           "media": media_kwargs}, sort_keys=True, default=str)
    return hashlib.sha256(f"{content_hash}|{settings}".encode()).hexdigest()


def salted_key(key: str, salt: str | None) -> str:
    """An item's key under a request's cache salt (vLLM's ``cache_salt``, or a tenant's, see
    engine.server.api.tenants): no entry is shared across salts; unsalted, the key itself."""
    if salt is None:
        return key
    return key + "|salt:" + hashlib.sha256(salt.encode()).hexdigest()[:32]


def content_hash(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class ProcessorCache:
    """Thread-safe LRU of processed items, at most ``max_bytes`` of tensors (0 disables)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(int(max_bytes), 0)
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @classmethod
    def from_gb(cls, gb: float) -> ProcessorCache:
        return cls(int(gb * GIB))

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return entry[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        if not self.enabled or nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self.stats.bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self.stats.bytes += nbytes
            while self.stats.bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self.stats.bytes -= size
                self.stats.evictions += 1
            self.stats.entries = len(self._items)

    def discard(self, keys: list[str]) -> None:
        """Drop these entries, where present."""
        with self._lock:
            for key in keys:
                entry = self._items.pop(key, None)
                if entry is not None:
                    self.stats.bytes -= entry[1]
            self.stats.entries = len(self._items)

    def clear(self) -> int:
        """Drop every entry (``POST /reset_mm_cache``); the hit and miss counts stay. Returns
        how many entries were dropped."""
        with self._lock:
            dropped = len(self._items)
            self._items.clear()
            self.stats.bytes = self.stats.entries = 0
            return dropped
