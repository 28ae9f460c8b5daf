"""Clients' media uuids (vLLM's ``uuid`` beside a content part's media) -> the content they
named, so a later part may leave the media out and send the uuid alone.

vLLM takes a client's uuid as the item's cache key, so the same uuid sent with other content
was served the first content's features (vLLM #55547). Here no cache is keyed by a uuid:
every cache keys an item by its content (the encoded bytes and the settings that change the
result, :func:`engine.processing.cache.item_key`), and a uuid is only a tenant's name for
content it sent. This store keeps, per tenant and uuid, the modality and the encoded bytes last
sent under it; a part that leaves its media out is rebuilt from them and goes through the same
caches under the same keys as the part with its media did, so it is answered the same.

- The same uuid with other content re-points the uuid to the new content (the last one sent
  wins). Caches stay keyed by content, so nothing made from the old content is ever served for
  the new, and the old content's own entries are untouched.
- Per tenant: the key is the tenant (the request's effective cache salt: its ``cache_salt``,
  and its API key's salt under ``--cache-salt-per-api-key``) with the uuid; one tenant cannot
  name another's uuid (it gets the same 400 as for a uuid never sent).
- Bounded: at most ``--mm-uuid-cache-gb`` of encoded media per API server process, least
  recently used first out; a uuid that was evicted is a 400 that says it may have been.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.processing.cache import GIB, ProcessorCache

if TYPE_CHECKING:
    from engine.processing.chat_parts import MediaRef
    from engine.processing.preprocess import MediaItem

#: the flag that sizes the store (named in its errors)
FLAG = "--mm-uuid-cache-gb"


def _key(tenant: str | None, uuid: str) -> str:
    scope = hashlib.sha256((tenant or "").encode()).hexdigest()[:32] if tenant else "-"
    return f"{scope}|{uuid}"


class MediaUuids:
    """Per tenant and uuid, the (modality, encoded bytes) last sent under it; LRU, at most
    ``max_bytes`` of media (0: uuids name nothing, a part without its media is a 400)."""

    def __init__(self, max_bytes: int) -> None:
        self._lru = ProcessorCache(max_bytes)  # (a thread-safe LRU bounded in bytes)

    @classmethod
    def from_gb(cls, gb: float) -> MediaUuids:
        return cls(int(gb * GIB))

    def held(self, refs: list[MediaRef], tenant: str | None) -> list[tuple[str, bytes] | None]:
        """For each part that left its media out, the content its uuid names (None for the
        parts that carry theirs); a uuid this tenant never sent, sent as another modality,
        or evicted is a 400 naming the part and the uuid."""
        out: list[tuple[str, bytes] | None] = []
        for ref in refs:
            if ref.url is not None:
                out.append(None)
                continue
            if ref.uuid is None:  # (chat_parts lets no such part through; never a 500)
                raise InvalidRequestError(f"{ref.where}: a {ref.modality} part needs its media "
                                          "or a uuid", param=ref.where,
                                          code="invalid_content_part")
            held = self._lru.get(_key(tenant, ref.uuid)) if self._lru.enabled else None
            if held is None:
                why = (f"this server keeps no media by uuid ({FLAG} 0)" if not self._lru.enabled
                       else "never sent with its media by this tenant (the same cache_salt "
                            "and API key), or evicted since (the server keeps the last "
                            f"{FLAG} of media sent with a uuid)")
                raise InvalidRequestError(
                    f"{ref.where}: {ref.modality} uuid {ref.uuid!r} names no media this "
                    f"server holds: {why}", param=f"{ref.where}.uuid", code="unknown_media_uuid",
                    hint="send the part with its media and this uuid again")
            if held[0] != ref.modality:
                raise InvalidRequestError(
                    f"{ref.where}: uuid {ref.uuid!r} names {held[0]} media, not {ref.modality}",
                    param=f"{ref.where}.uuid", code="unknown_media_uuid",
                    hint=f"refer to it from a {held[0]} part")
            out.append(held)
        return out

    def remember(self, refs: list[MediaRef], items: list[MediaItem], tenant: str | None
                 ) -> None:
        """Name, for this tenant, each part's content by its uuid (parts with media and a
        uuid; ``items``: the request's items, in the same order as ``refs``). A uuid already
        naming other content now names this one."""
        if not self._lru.enabled:
            return
        for ref, item in zip(refs, items, strict=True):
            if ref.uuid is not None and ref.url is not None and item.encoded is not None:
                self._lru.put(_key(tenant, ref.uuid), (ref.modality, item.encoded),
                              len(item.encoded))

    def clear(self) -> int:
        """Forget every uuid; how many were dropped."""
        return self._lru.clear()
