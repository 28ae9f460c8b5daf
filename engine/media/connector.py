"""The media connector: a URL and a modality in, checked and fetched bytes out.

Use :meth:`MediaConnector.check` on every item of a request first (no byte is fetched, hosts
are resolved and judged), then :meth:`MediaConnector.fetch` each checked source::

    async with MediaConnector(policy, limits) as connector:
        sources = [await connector.check(url, "image") for url in urls]   # may raise 4xx
        media = await asyncio.gather(*(connector.fetch(s) for s in sources))
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine.config import MediaLimits, MediaPolicy, Modality
from engine.errors import InternalError
from engine.media.addresses import Lookup
from engine.media.data_url import decode_base64_payload
from engine.media.http_fetch import HttpFetcher
from engine.media.inflight import Ticket
from engine.media.local_file import read_local_file
from engine.media.policy import MediaSource, SourceKind, parse_source
from engine.media.sniff import check_kind


@dataclass(frozen=True)
class FetchedMedia:
    """Bytes of one media item and what was learned fetching them."""

    data: bytes
    modality: Modality
    source: SourceKind
    display: str
    mime: str | None
    declared_mime: str | None
    fetch_s: float
    redirects: int = 0
    attempts: int = 1

    @property
    def size(self) -> int:
        return len(self.data)


class MediaConnector:
    """Applies a :class:`MediaPolicy` and :class:`MediaLimits` to media references."""

    def __init__(
        self,
        policy: MediaPolicy | None = None,
        limits: MediaLimits | None = None,
        *,
        lookup: Lookup | None = None,
    ) -> None:
        self.policy = policy or MediaPolicy.create()
        self.limits = limits or MediaLimits.from_env()
        self._http = HttpFetcher(self.policy, self.limits, lookup)

    async def __aenter__(self) -> MediaConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.close()

    async def check(self, url: str, modality: Modality) -> MediaSource:
        """Every policy rule, host resolution included; fetches nothing."""
        source = parse_source(url, modality, self.policy, self.limits)
        if source.kind == "http" and source.host is not None:
            await self._http.resolver.check_host(source.host)
        return source

    async def check_all(self, items: list[tuple[str, Modality]]) -> list[MediaSource]:
        """Check a whole request's items; the first refusal raises before anything is fetched."""
        return list(await asyncio.gather(*(self.check(url, m) for url, m in items)))

    async def fetch(self, source: MediaSource, ticket: Ticket | None = None,
                    started: float | None = None) -> FetchedMedia:
        """The bytes of a checked source, sniffed against its modality; charged to ``ticket``
        (the server's in-flight media bound) when given; an http fetch's deadline counts from
        ``started`` (see :meth:`HttpFetcher.fetch`)."""
        start = time.perf_counter()
        cap = self.limits.for_modality(source.modality).max_bytes
        redirects, attempts = 0, 1
        if source.kind == "http" and source.http_url is not None:
            result = await self._http.fetch(source.http_url, source.modality, ticket, started)
            data, declared = result.data, result.content_type
            redirects, attempts = result.redirects, result.attempts
        elif source.kind == "data" and source.data_payload is not None:
            data, declared = decode_base64_payload(source.data_payload), source.data_mime
            if ticket is not None and not ticket.covers_inline_media:
                ticket.charge(len(data))
        elif source.kind == "file" and source.local_parts is not None:
            root = self.policy.allowed_local_path
            if root is None:
                raise InternalError("file source without an allowed local media path")
            data = await asyncio.to_thread(
                read_local_file, root, source.local_parts, cap, source.modality
            )
            declared = None
            if ticket is not None:
                ticket.charge(len(data))
        else:
            raise InternalError(f"unfetchable media source kind {source.kind!r}")
        mime = check_kind(data, source.modality)
        return FetchedMedia(
            data=data,
            modality=source.modality,
            source=source.kind,
            display=source.display,
            mime=mime,
            declared_mime=declared,
            fetch_s=time.perf_counter() - start,
            redirects=redirects,
            attempts=attempts,
        )

    async def load_bytes(self, url: str, modality: Modality) -> FetchedMedia:
        """:meth:`check` then :meth:`fetch` one item."""
        return await self.fetch(await self.check(url, modality))
