"""Fetch media over http(s) with aiohttp, under the operator's policy.

- Connections go through :class:`~engine.media.addresses.PolicyResolver`: only checked
  addresses are connected to. Proxy variables are ignored (``trust_env=False``).
- Redirects are followed by hand, at most ``max_redirects``, each hop re-checked.
- The byte cap is enforced from ``Content-Length`` before reading and again while streaming,
  on the decompressed body.
- The modality's timeout is one deadline for the whole fetch, retries included. Only
  timeouts, connection errors and 5xx answers are retried.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import aiohttp
from yarl import URL

from engine.config import MediaLimits, MediaPolicy, Modality
from engine.errors import AphroditeError, InternalError, MediaFetchError, MediaTooLargeError
from engine.media.addresses import Lookup, PolicyResolver
from engine.media.inflight import Ticket
from engine.media.policy import check_http_url, display_url, parse_http_url
from engine.version import __version__

_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class HttpResult:
    data: bytes
    content_type: str | None
    final_url: str
    attempts: int
    redirects: int


class _Retryable(Exception):
    """An attempt failed in a way worth one more try."""

    def __init__(self, error: MediaFetchError):
        super().__init__(str(error))
        self.error = error


class HttpFetcher:
    """One aiohttp session (per event loop) that fetches media under a policy."""

    def __init__(self, policy: MediaPolicy, limits: MediaLimits, lookup: Lookup | None = None):
        self.policy = policy
        self.limits = limits
        self.resolver = PolicyResolver(policy, lookup)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                resolver=self.resolver, use_dns_cache=False, limit=64, limit_per_host=16
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,
                headers={"User-Agent": f"aphrodite/{__version__}"},
                auto_decompress=True,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: URL, modality: Modality, ticket: Ticket | None = None,
                    started: float | None = None) -> HttpResult:
        """The body at ``url``; raises a :class:`~engine.errors.ClientError` subclass. Bytes
        are charged to ``ticket`` (the in-flight bound) as they arrive. The modality's fetch
        timeout counts from ``started`` (the event loop's clock; default now), so time the
        request spent waiting for a fetch slot is part of it."""
        caps = self.limits.for_modality(modality)
        loop = asyncio.get_running_loop()
        deadline = (started if started is not None else loop.time()) + caps.fetch_timeout_s
        env_name = f"APHRODITE_{modality.upper()}_FETCH_TIMEOUT"
        attempts = 0
        last: MediaFetchError | None = None
        try:
            async with asyncio.timeout_at(deadline):
                for attempt in range(self.limits.fetch_retries + 1):
                    attempts = attempt + 1
                    try:
                        return await self._attempt(url, modality, caps.max_bytes, attempts, ticket)
                    except _Retryable as retry:
                        last = retry.error
                        if attempt < self.limits.fetch_retries:
                            await asyncio.sleep(0.1 * (2**attempt) * (0.5 + random.random()))
        except TimeoutError:
            raise MediaFetchError(
                f"fetching the {modality} at {display_url(str(url))!r} took longer than "
                f"{caps.fetch_timeout_s:g} s",
                hint=f"raise {env_name} or serve the media faster",
                code="media_fetch_timeout",
            ) from None
        raise last or InternalError("media fetch ended without a result")

    async def _attempt(self, url: URL, modality: Modality, cap: int, attempt: int,
                       ticket: Ticket | None) -> HttpResult:
        session = self._get_session()
        current = url
        for hop in range(self.policy.max_redirects + 1):
            current = check_http_url(current, self.policy)
            await self.resolver.check_host(current.raw_host or "")
            try:
                async with session.get(current, allow_redirects=False) as resp:
                    if resp.status in _REDIRECTS and "Location" in resp.headers:
                        current = _redirect_target(current, resp.headers["Location"])
                        continue
                    return await self._read(resp, current, modality, cap, attempt, hop, ticket)
            except AphroditeError:
                raise
            except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
                raise _Retryable(_fetch_error(current, "timed out")) from exc
            except aiohttp.ClientConnectionError as exc:
                raise _Retryable(_fetch_error(current, "could not be connected to")) from exc
            except aiohttp.ClientPayloadError as exc:
                raise _Retryable(_fetch_error(current, "sent a broken body")) from exc
            except aiohttp.ClientError as exc:
                raise _fetch_error(current, "could not be fetched") from exc
        raise MediaFetchError(
            f"media URL {display_url(str(url))!r} redirected more than "
            f"{self.policy.max_redirects} times",
            hint="link the media directly, or raise APHRODITE_MEDIA_MAX_REDIRECTS",
            code="media_too_many_redirects",
        )

    async def _read(
        self,
        resp: aiohttp.ClientResponse,
        url: URL,
        modality: Modality,
        cap: int,
        attempt: int,
        hops: int,
        ticket: Ticket | None,
    ) -> HttpResult:
        shown = display_url(str(url))
        if resp.status >= 500:
            raise _Retryable(_fetch_error(url, f"answered HTTP {resp.status}"))
        if resp.status >= 400 or resp.status < 200 or resp.status in _REDIRECTS:
            raise _fetch_error(url, f"answered HTTP {resp.status}", code="media_fetch_status")
        too_big = MediaTooLargeError(
            f"the {modality} at {shown!r} is over the {cap}-byte cap",
            hint=f"send a smaller {modality} or raise APHRODITE_MAX_{modality.upper()}_BYTES",
        )
        if resp.content_length is not None and resp.content_length > cap:
            raise too_big
        body = bytearray()
        charged = 0  # what this attempt charged: the ticket also holds the request's other items
        try:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                if len(body) + len(chunk) > cap:
                    raise too_big
                if ticket is not None:
                    ticket.charge(len(chunk))
                    charged += len(chunk)
                body += chunk
        except BaseException:
            if ticket is not None:  # this attempt's bytes are dropped: give them back
                ticket.refund(charged)
            raise
        return HttpResult(bytes(body), resp.content_type or None, str(url), attempt, hops)


def _redirect_target(current: URL, location: str) -> URL:
    """The URL a ``Location`` header points to; one the URL library cannot parse is the media
    host's fault, a 400 like any other failed fetch (never a 500)."""
    try:
        return current.join(parse_http_url(location))
    except AphroditeError:
        raise _fetch_error(current, "redirected to a malformed URL",
                           code="media_malformed_redirect") from None
    except Exception as exc:
        raise _fetch_error(current, "redirected to a malformed URL",
                           code="media_malformed_redirect") from exc


def _fetch_error(url: URL, what: str, code: str = "media_fetch_failed") -> MediaFetchError:
    return MediaFetchError(
        f"the media server for {display_url(str(url))!r} {what}",
        hint="check that the URL is reachable from the server",
        code=code,
    )
