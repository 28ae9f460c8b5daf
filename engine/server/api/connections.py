"""Connection limits of one API server (CONTRIBUTING.md's request map, step 0).

Before any request is read, a connection costs a descriptor and a little memory; without
limits one client holding ~1,100 idle connections exhausted a 1,024-descriptor limit, so
nobody was served and every failed ``accept`` logged a traceback. Here:

- the open-file limit is raised to the hard limit at start (:func:`raise_open_file_limit`);
- at most ``per_client`` connections per client (its peer address; an IPv6 peer by its /64,
  as the fetch slots count it) and at most ``total`` in all, kept below the open-file limit
  so ``accept`` itself never runs out. A connection past either takes the place of an idle
  one, the oldest first (the client's own past its cap, anyone's past the total): behind a
  reverse proxy, a load balancer or an ingress every user is one address, and a gateway
  holding hundreds of idle keep-alive connections must still be served. Only when every
  connection it could replace is busy with a request is the new one answered 503 +
  ``Retry-After`` and closed at once;
- a connection must send its first request's headers within ``header_timeout_s``; between
  requests aiohttp's keep-alive timer (``--keep-alive-timeout-s``) closes an idle one (and one
  that sent only part of its next request's headers: that timer is not reset by partial data);
- an ``accept`` error is logged once, then counted, with a summary at most once a minute.

The guard hooks the aiohttp ``Server`` (the protocol factory) through its public callbacks:
``connection_made``/``connection_lost`` (called by each connection's handler) and
``request_factory`` (called once per request whose headers arrived). Whether a connection is
idle is read from its handler as aiohttp's own keep-alive timer reads it (no request being
handled, none queued); a handler without those fields is never taken for idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from typing import Any

from engine.server.api.fetch_slots import client_key

logger = logging.getLogger("aphrodite.server")

#: descriptors kept for everything but client connections (decode worker pipes, media
#: fetches, model and cache files, shared memory)
RESERVED_FDS = 256


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; returns the soft limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def total_connection_cap(open_file_limit: int | None = None) -> int:
    """Connections one API server accepts: the open-file limit minus a reserve."""
    limit = open_file_limit or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        limit = 1 << 20
    return max(64, limit - RESERVED_FDS)


def _refusal(message: str, hint: str) -> bytes:
    body = json.dumps({"error": {"message": f"{message} ({hint})", "type":
                                 "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


#: a connection is sheddable only this long after it was opened or last sent a request's
#: headers: aiohttp hands a request it has read to a task that marks the connection busy a
#: moment later, and a connection must not be closed in between (its request lost)
ACTIVE_GRACE_S = 0.25


def _idle(handler: Any) -> bool:
    """No request being handled or waiting on ``handler``'s connection (before its first
    request, or between two): the state aiohttp's keep-alive timer closes."""
    return not getattr(handler, "_request_in_progress", True) and \
        not getattr(handler, "_messages", True)


class ConnectionGuard:
    """Counts connections per client and in all, makes room for a new one by closing the
    oldest idle ones, and closes connections whose first request's headers do not arrive in
    time. Runs on the event loop."""

    def __init__(self, *, per_client: int, total: int, header_timeout_s: float,
                 active_grace_s: float = ACTIVE_GRACE_S) -> None:
        self.per_client = per_client
        self.active_grace_s = active_grace_s
        self.total = total
        self.header_timeout_s = header_timeout_s
        self.by_client: Counter[str] = Counter()
        self.open = 0
        self.refused = 0
        self.shed = 0  # idle connections closed to make room for new ones
        self.header_timeouts = 0
        #: every connection, least recently active first, with its client, header timer and
        #: when it was opened or last sent a request's headers (time.monotonic)
        self._tracked: OrderedDict[Any, tuple[str, asyncio.TimerHandle | None, float]] = \
            OrderedDict()
        #: each client's connections, least recently active first
        self._of_client: dict[str, OrderedDict[Any, None]] = {}

    def install(self, server: Any) -> None:
        """Hook ``server`` (an ``aiohttp.web.Server``) before it takes connections."""
        made, lost, factory = (server.connection_made, server.connection_lost,
                               server.request_factory)

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self._admit(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._release(handler)
            lost(handler, exc)

        def request_factory(message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
            self._headers_arrived(protocol)
            return factory(message, payload, protocol, *args)

        server.connection_made = connection_made
        server.connection_lost = connection_lost
        server.request_factory = request_factory

    def _admit(self, handler: Any, transport: Any) -> None:
        peer = transport.get_extra_info("peername")
        key = client_key(peer[0] if isinstance(peer, (tuple, list)) and peer else None)
        if self.open >= self.total and not self._shed_oldest_idle(self._tracked):
            self._refuse(handler, transport, f"this API server holds {self.open} connections, "
                         "each busy with a request",
                         "retry later; the bound is the open-file limit (ulimit -n)")
            return
        if self.per_client and self.by_client[key] >= self.per_client and \
                not self._shed_oldest_idle(self._of_client[key]):
            self._refuse(handler, transport,
                         f"this client already holds {self.by_client[key]} connections, each "
                         "busy with a request",
                         "wait for an answer first, or raise --max-connections-per-client")
            return
        self.open += 1
        self.by_client[key] += 1
        timer = (asyncio.get_running_loop().call_later(self.header_timeout_s, self._expire,
                                                       handler)
                 if self.header_timeout_s > 0 else None)
        self._tracked[handler] = (key, timer, time.monotonic())
        self._of_client.setdefault(key, OrderedDict())[handler] = None

    def _shed_oldest_idle(self, among: OrderedDict[Any, Any]) -> bool:
        """Close the least recently active idle connection of ``among``; False when all
        are busy."""
        quiet_since = time.monotonic() - self.active_grace_s
        oldest = None
        for handler in among:  # least recently active first
            if self._tracked[handler][2] > quiet_since:
                return False  # this one, and every one after it, active within the grace
            if _idle(handler):
                oldest = handler
                break
        if oldest is None:
            return False
        self.shed += 1
        self._release(oldest)  # counted out now: its connection_lost comes a step later
        oldest.force_close()
        return True

    def _refuse(self, handler: Any, transport: Any, message: str, hint: str) -> None:
        self.refused += 1
        transport.write(_refusal(message, hint))
        handler.force_close()

    def _headers_arrived(self, handler: Any) -> None:
        entry = self._tracked.get(handler)
        if entry is None:
            return
        if entry[1] is not None:
            entry[1].cancel()
        self._tracked[handler] = (entry[0], None, time.monotonic())
        self._tracked.move_to_end(handler)  # the most recently active now
        self._of_client[entry[0]].move_to_end(handler)

    def _expire(self, handler: Any) -> None:
        entry = self._tracked.get(handler)
        if entry is not None and entry[1] is not None:
            self.header_timeouts += 1
            handler.force_close()

    def _release(self, handler: Any) -> None:
        entry = self._tracked.pop(handler, None)
        if entry is None:
            return
        key, timer, _ = entry
        if timer is not None:
            timer.cancel()
        self.open -= 1
        self.by_client[key] -= 1
        mine = self._of_client.get(key)
        if mine is not None:
            mine.pop(handler, None)
        if self.by_client[key] <= 0:
            del self.by_client[key]
            self._of_client.pop(key, None)


class AcceptErrorLog:
    """A loop exception handler that logs ``accept`` failures (out of descriptors) once, then
    counts them and logs a one-line summary at most every ``every_s`` seconds; everything
    else goes to the default handler."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.count = 0
        self._logged_at: float | None = None
        self._unlogged = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if not message.startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if self._logged_at is None:
            self._logged_at = now
            logger.error("accepting a connection failed (%s); further accept errors are "
                         "counted and summarised", context.get("exception"))
        elif now - self._logged_at >= self.every_s:
            logger.error("%d more accept errors in the last %.0f s", self._unlogged + 1,
                         now - self._logged_at)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
