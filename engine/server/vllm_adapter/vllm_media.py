"""``--engine vllm``: media that vLLM's processor cache holds already is named, not sent.

vLLM names each item by a content hash and keeps its processed tensors in its processor
cache (``--mm-processor-cache-gb``); a request may name an item by a ``multi_modal_uuids``
entry instead of hashing it, and leave out the data of an item that cache holds. This API
server names every item by its own content key (:func:`item_uuid`: the encoded bytes, the
settings that change the decoded result and the request's processor kwargs, the key our
processor cache uses), and keeps a
ledger of the keys it has sent with data in requests that ran (:class:`Ledger`, LRU, bounded
by an estimate of the processed bytes vLLM keeps for them). An item whose key is in the
ledger is neither decoded nor copied to the engine: a warm request skips this server's decode
and vLLM's hashing as well as vLLM's processor.

The ledger is a guess: vLLM evicts by its own sizes, and another API server's requests fill
the same cache. When vLLM no longer holds an item it was not sent, the bridge answers
``mm_data_needed`` before any token (``vllm_inputs.DATA_NEEDED``), and :func:`generate` decodes the
request's left-out items, forgets their keys and submits it once more with the data: a wrong
guess costs one round trip, never a failed request; an item vLLM lacked twice is not left out
again (:data:`MAX_MISSES`). A cache reset (``POST /reset_mm_cache``)
empties every API server's ledger with its processor cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.media.pool import decode_executor
from engine.processing.cache import GIB, ProcessorCache, content_hash, item_key, salted_key
from engine.server.process.wire import Done
from engine.server.vllm_adapter.vllm_inputs import DATA_NEEDED

if TYPE_CHECKING:
    from engine.processing.preprocess import MediaItem, ProcessedPrompt

logger = logging.getLogger("aphrodite.server")

#: processed bytes per decoded byte that vLLM keeps for an item (Qwen2-VL style patches:
#: float32 pixel values, about 8x an image's or a clip's uint8 RGB)
PROCESSED_PER_DECODED = {"image": 8, "video": 8, "audio": 1}
#: the least an item is counted at: processors scale small images up (Qwen2-VL's minimum of
#: 56x56 pixels is 19-75 KB processed), and it bounds the ledger's entries (4 GB: 262,144)
MIN_ITEM_BYTES = 16 << 10


#: an item vLLM lacked this many times after this server left it out is always sent with its
#: data from then on (vLLM does not keep it: an encoder-decoder model, where vLLM turns its
#: cache off, or an item over vLLM's own budget that our estimate fits), instead of costing
#: two round trips on every repeat; one miss is an ordinary eviction
MAX_MISSES = 2
#: the keys whose misses are counted (LRU): a bound on the memo's memory
MISS_MEMO = 4096


class Ledger:
    """The content keys this API server has sent to vLLM with data, in requests that ran:
    LRU, at most ``max_bytes`` of estimated processed tensors (0: off, every item is sent);
    and how often vLLM lacked each one it was told to hold (see :data:`MAX_MISSES`)."""

    def __init__(self, max_bytes: int) -> None:
        self._keys = ProcessorCache(max_bytes)
        self._misses: OrderedDict[str, int] = OrderedDict()

    @classmethod
    def from_gb(cls, gb: float) -> Ledger:
        return cls(int(gb * GIB))

    @property
    def enabled(self) -> bool:
        return self._keys.enabled

    def holds(self, key: str) -> bool:
        return self._keys.get(key) is not None

    def remember(self, entries: list[tuple[str, int]]) -> None:
        for key, nbytes in entries:
            if self._misses.get(key, 0) < MAX_MISSES:
                self._keys.put(key, True, nbytes)

    def forget(self, keys: list[str]) -> None:
        """vLLM lacked these items although this ledger held them."""
        self._keys.discard(keys)
        for key in keys:
            self._misses[key] = self._misses.pop(key, 0) + 1
        while len(self._misses) > MISS_MEMO:
            self._misses.popitem(last=False)

    def clear(self) -> int:
        self._misses.clear()
        return self._keys.clear()


def item_uuid(model: str, item: MediaItem, processor_kwargs: dict[str, Any] | None,
              salt: str | None = None) -> str | None:
    """An item's name for vLLM: this server's content key of its encoded bytes, the settings
    that change its decoded result and the request's processor kwargs, which change what vLLM
    keeps for it, under the request's cache salt (vLLM keys its processor and encoder caches
    by the name, so tenants share neither, nor this server's ledger); None for an item that
    came decoded."""
    if item.encoded is None:
        return None
    return salted_key(item_key(model, item.modality, content_hash(item.encoded),
                               processor_kwargs or {}, item.media_kwargs), salt)


def estimate(modality: str, decoded: Any) -> int:
    """The processed bytes vLLM will keep for a decoded item (see PROCESSED_PER_DECODED)."""
    array = decoded[0] if isinstance(decoded, tuple) else decoded
    nbytes = getattr(array, "nbytes", None)
    if nbytes is None and hasattr(array, "size") and hasattr(array, "mode"):  # a PIL image
        nbytes = array.size[0] * array.size[1] * len(array.getbands())
    return max(int(nbytes or 0) * PROCESSED_PER_DECODED.get(modality, 1), MIN_ITEM_BYTES)


async def generate(engine: Any, ledger: Ledger | None, prompt: ProcessedPrompt,
                   sampling: dict[str, Any], on_resend: Callable[[], Any] | None = None,
                   slot: Callable[[], Any] = contextlib.nullcontext,
                   on_items: Callable[[list[bool]], Any] | None = None, priority: int = 0):
    """``engine.generate`` for one prompt of ``--engine vllm``: when vLLM lacks an item that
    was left out, once more with every item's data (``on_resend`` is called; the items are
    decoded inside ``slot()``, the API server's preprocessing slot, as a new request's are:
    a server full of preprocessing answers the resend's 503 rather than decode past its
    bound); once the request ran, its items' keys go into the ledger and ``on_items`` gets
    which of its items were left out and found in vLLM's cache (the processor cache's hits:
    after a resend, none)."""
    mm = prompt.mm
    yielded = False
    for attempt in (0, 1):
        try:
            async for message in engine.generate(prompt.input_ids, mm, sampling,
                                                 (prompt.mm_hashes, prompt.mm_positions),
                                                 prompt.text, prompt.processor_kwargs,
                                                 priority=priority,
                                                 cache_salt=prompt.cache_salt):
                if isinstance(message, Done):
                    if ledger is not None:
                        ledger.remember(prompt.mm_sent)
                    if on_items is not None:
                        on_items(list(prompt.item_hits))
                yielded = True
                yield message
            return
        except EngineError as err:
            if attempt or yielded or err.code != DATA_NEEDED or prompt.refill is None:
                raise
            left_out = [k for k, hit in zip(prompt.mm_hashes, prompt.item_hits, strict=True)
                        if hit]
            logger.info("vLLM no longer holds %d item(s) of a request: sending their data",
                        len(left_out))
            if ledger is not None:
                ledger.forget(left_out)  # (vLLM lacks them, whether or not this resend goes)
            with slot():
                if on_resend is not None:
                    on_resend()
                mm, sent = await asyncio.get_running_loop().run_in_executor(
                    decode_executor(), prompt.refill)
            prompt.mm_sent = sent
            prompt.item_hits = [False] * len(prompt.item_hits)  # all sent with their data
