"""The media fetch slots of one API server: ``--max-concurrent-fetches`` in all, at most
``--max-fetches-per-client`` of them held by one client.

A client is the peer address of its connection (an IPv6 peer: its /64, which one host
usually owns whole). Without the per-client share, one client sending many slow-drip URLs
holds every slot until their deadlines and every other client's media requests wait or fail;
with it, that client waits for its own slots (and gets ``fetch_slots_busy`` when its deadline
passes) while the others go on. At most as many of its requests wait as it may hold: past
that, a 503 at once, so its waiting requests cannot fill the decode queue in front of the
slots either. Waiting, for the client's share or for the pool, counts against the request's
fetch deadline.

Behind a reverse proxy every client has the proxy's address: there, set the share to 0 (no
per-client share) or raise it.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.errors import OverloadedError


def client_key(peer: str | None) -> str:
    """The client a peer address belongs to: IPv4 as is (an IPv4-mapped IPv6 address as its
    IPv4), IPv6 by its /64."""
    try:
        ip = ipaddress.ip_address((peer or "").split("%")[0])
    except ValueError:
        return peer or ""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Share:
    __slots__ = ("slots", "users")

    def __init__(self, size: int) -> None:
        self.slots = asyncio.Semaphore(size)
        self.users = 0  # requests holding or waiting for this client's slots


class FetchSlots:
    def __init__(self, total: int, per_client: int = 0) -> None:
        self.total = total
        self.per_client = per_client
        self._pool = asyncio.Semaphore(total)
        # Only clients with a request holding or waiting for a slot have an entry, so the
        # table is bounded by the requests in flight (--max-pending-requests).
        self._shares: dict[str, _Share] = {}

    @property
    def clients(self) -> int:
        """Clients holding or waiting for a slot now."""
        return len(self._shares)

    def _join(self, client: str) -> _Share | None:
        if self.per_client <= 0 or self.per_client >= self.total:
            return None  # no share smaller than the pool: the pool is the only limit
        share = self._shares.get(client)
        if share is None:
            share = self._shares[client] = _Share(self.per_client)
        if share.users >= 2 * self.per_client:  # its share held and as many waiting
            raise OverloadedError(
                f"this client already has {share.users} requests holding or waiting for its "
                f"{self.per_client} media fetch slots", code="fetch_slots_busy",
                hint="send fewer requests with remote media at once, or raise "
                     "--max-fetches-per-client")
        share.users += 1
        return share

    def _leave(self, client: str, share: _Share | None) -> None:
        if share is not None:
            share.users -= 1
            if share.users == 0:
                del self._shares[client]

    @asynccontextmanager
    async def hold(self, client: str, deadline: float, timeout_s: float) -> AsyncIterator[None]:
        """One slot for the block; waits at most until ``deadline`` (loop time), then 503."""
        share = self._join(client)
        try:
            waiting_for = "client"
            try:
                async with asyncio.timeout_at(deadline):
                    if share is not None:
                        await share.slots.acquire()
                    waiting_for = "pool"
                    try:
                        await self._pool.acquire()
                    except BaseException:
                        if share is not None:
                            share.slots.release()
                        raise
            except TimeoutError:
                raise self._busy(waiting_for, timeout_s) from None
            try:
                yield
            finally:
                self._pool.release()
                if share is not None:
                    share.slots.release()
        finally:
            self._leave(client, share)

    def _busy(self, waiting_for: str, timeout_s: float) -> OverloadedError:
        if waiting_for == "client":
            return OverloadedError(
                f"this client already holds {self.per_client} media fetch slots and none came "
                f"free within {timeout_s:g} s", code="fetch_slots_busy",
                hint="send fewer requests with slow media at once, or raise "
                     "--max-fetches-per-client")
        return OverloadedError(
            f"no media fetch slot came free within {timeout_s:g} s", code="fetch_slots_busy",
            hint="retry after the Retry-After seconds, or raise --max-concurrent-fetches")
