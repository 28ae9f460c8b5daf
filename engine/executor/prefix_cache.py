"""Prefix caching (vLLM's ``--enable-prefix-caching``): the keys and values of a prompt's
leading blocks, kept so a later prompt that starts the same way skips computing them.

A prompt is cut into blocks of ``block_size`` tokens; each full block is named by a hash
chained to its parent block's hash, its own token ids, and the content key of every media
item whose placeholder tokens fall in the block (the key covers the item's bytes and the
processor kwargs, so two images of one size give different hashes though their placeholder
tokens are the same). Reuse is by identity only: a block is reused when its hash, and so the
whole prefix up to it, is the same. Blocks are stored one entry each in an LRU bounded by bytes
(a prefix shared by many prompts is stored once); a prompt's blocks are touched last-first, so
eviction takes a prefix's deepest blocks before the ones other prompts may share.

Nothing here knows about tensors: a block's value is whatever the runner stores, with its size.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: vLLM's default block size
BLOCK_SIZE = 16


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE,
                 mm_hashes: Sequence[str] = (), mm_positions: Sequence[tuple[int, int]] = (),
                 salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids``. Item ``k`` (content key
    ``mm_hashes[k]``) holds the tokens ``[offset, offset + length)`` of ``mm_positions[k]``;
    its key goes into every block those tokens touch. ``salt`` (``cache_salt``) seeds the
    chain, as vLLM mixes it into the first block: every block of a salted prompt differs
    from the same tokens' under another salt or none."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if len(mm_hashes) != len(mm_positions):
        raise ValueError("one position range per media item")
    out: list[bytes] = []
    parent = b"" if salt is None else hashlib.sha256(b"salt:" + salt.encode()).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[start:end]).tobytes())
        for key, (offset, length) in zip(mm_hashes, mm_positions, strict=True):
            if offset < end and offset + length > start:
                h.update(b"|mm:" + key.encode())
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    """Tokens looked up and found (vLLM's ``prefix_cache_queries``/``_hits``), blocks held."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    bytes: int = 0
    blocks: int = 0


class PrefixCache:
    """Thread-safe LRU of blocks keyed by their chained hash, at most ``max_bytes``."""

    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.max_bytes = max(int(max_bytes), 0)
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = PrefixCacheStats()

    def hashes(self, token_ids: Sequence[int], mm_hashes: Sequence[str] = (),
               mm_positions: Sequence[tuple[int, int]] = (), salt: str | None = None
               ) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, mm_hashes, mm_positions, salt)

    def longest(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, are cached (nothing is touched)."""
        with self._lock:
            count = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                count += 1
            return count

    def get(self, hashes: Sequence[bytes]) -> list[Any]:
        """The values of ``hashes`` (all cached: see :meth:`longest`), touched last-first so
        their first blocks are the last to be evicted."""
        with self._lock:
            values = [self._blocks[h][0] for h in hashes]
            for h in reversed(hashes):
                self._blocks.move_to_end(h)
            return values

    def record(self, queried: int, hit: int) -> None:
        """Count one lookup: ``queried`` prompt tokens, ``hit`` of them reused."""
        with self._lock:
            self.stats.queries += queried
            self.stats.hits += hit

    def missing(self, hashes: Sequence[bytes]) -> list[int]:
        """Indices of the ``hashes`` not cached (what :meth:`put` needs values for)."""
        with self._lock:
            return [i for i, h in enumerate(hashes) if h not in self._blocks]

    def put(self, hashes: Sequence[bytes], values: dict[int, tuple[Any, int]]) -> None:
        """Store ``values[i] = (value, nbytes)`` under ``hashes[i]``; blocks already cached
        are touched. Then the least recently used blocks go until the bound holds."""
        if self.max_bytes <= 0:
            return
        with self._lock:
            for i in reversed(range(len(hashes))):
                h = hashes[i]
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                elif i in values and values[i][1] <= self.max_bytes:
                    self._blocks[h] = values[i]
                    self.stats.bytes += values[i][1]
            while self.stats.bytes > self.max_bytes:
                _, (_, size) = self._blocks.popitem(last=False)
                self.stats.bytes -= size
                self.stats.evictions += 1
            self.stats.blocks = len(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> int:
        """Drop every block (``POST /reset_prefix_cache``); the counters of lookups stay.
        Returns how many blocks were dropped."""
        with self._lock:
            dropped = len(self._blocks)
            self._blocks.clear()
            self.stats.bytes = self.stats.blocks = 0
            return dropped


def usable_prefix(cached: int, length: int, media: tuple[int, int] | None,
                  block_size: int = BLOCK_SIZE, *, inside_media: bool = False) -> int:
    """How many of a prompt's first ``cached`` tokens (whole blocks found in the cache) a
    prefill may take from it: never the last token (its logits give the first output token,
    as vLLM recomputes it), and never part of the media span ``[first, last]`` unless
    ``inside_media`` (the prefill resumes from the model's merged embeddings,
    :mod:`engine.executor.media_embeds`; else the encoder's output lands in one forward pass:
    all of the span is reused, or none of it)."""
    usable = min(cached, (length - 1) // block_size * block_size)
    if not inside_media and media is not None and media[0] < usable <= media[1]:
        usable = media[0] // block_size * block_size
    return max(usable, 0)
