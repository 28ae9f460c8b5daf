"""Which network addresses media may be fetched from, and a resolver that enforces it.

A host is resolved once; every address it resolves to is classified, and a host with any
non-public address is refused unless the operator listed it in ``--allowed-media-domains``.
The connection then goes to exactly the addresses that were checked (the resolver below is the
one aiohttp connects with), so a second DNS answer cannot swap in a private address.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp.abc import AbstractResolver, ResolveResult

from engine.config import MediaPolicy, normalize_host
from engine.errors import MediaFetchError, MediaPolicyError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

#: A function that turns a host name into addresses (tests swap in their own DNS).
Lookup = Callable[[str], Awaitable[list[str]]]


def address_class(ip: IPAddress) -> str | None:
    """The name of the forbidden class ``ip`` falls in, or ``None`` for a public address.

    IPv6 spellings that carry an IPv4 address are judged by the IPv4 address inside:
    IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible (``::a.b.c.d``), 6to4 (``2002:AABB:CCDD::``)
    and NAT64 (``64:ff9b::a.b.c.d``, RFC 6052: a NAT64 gateway connects to the IPv4 address).
    """
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is None and int(ip) >> 32 == 0 and int(ip) > 1:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)  # ::a.b.c.d (deprecated form)
        if inner is not None:
            return address_class(inner)
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local (cloud metadata)", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("CGNAT", isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
    )
    for name, hit in checks:
        if hit:
            return name
    return None if ip.is_global else "non-global"


async def system_lookup(host: str) -> list[str]:
    """Resolve with the system resolver (getaddrinfo), as any client would."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class PolicyResolver(AbstractResolver):
    """Resolve a host, refuse it if any address is forbidden, and remember the answer.

    :meth:`check_host` runs before any connection; aiohttp then calls :meth:`resolve` for the
    connection and gets the same checked addresses back from the short-lived pin table.
    """

    #: Most pinned host names kept (the oldest go first): a client sending many distinct
    #: names cannot grow the table without end. Expired entries are dropped as new ones come.
    MAX_PINS = 4096

    def __init__(self, policy: MediaPolicy, lookup: Lookup | None = None, ttl_s: float = 30.0):
        self._policy = policy
        self._lookup = lookup or system_lookup
        self._ttl_s = ttl_s
        self._pins: collections.OrderedDict[str, tuple[float, list[str]]] = (
            collections.OrderedDict())

    @property
    def pinned(self) -> int:
        """How many host names are pinned now."""
        return len(self._pins)

    def _pin(self, key: str, addresses: list[str]) -> None:
        now = time.monotonic()
        self._pins[key] = (now, addresses)
        self._pins.move_to_end(key)
        while self._pins:
            oldest, (at, _) = next(iter(self._pins.items()))
            if len(self._pins) <= self.MAX_PINS and now - at < self._ttl_s:
                break
            del self._pins[oldest]

    async def check_host(self, host: str) -> list[str]:
        """Addresses for ``host`` that may be connected to; raises if the host is refused."""
        key = normalize_host(host)
        pinned = self._pins.get(key)
        if pinned and time.monotonic() - pinned[0] < self._ttl_s:
            return pinned[1]
        try:
            literal = ipaddress.ip_address(key)
        except ValueError:
            literal = None
        listed = key in self._policy.allowed_domains
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = await self._lookup(key)
            except (OSError, UnicodeError):
                addresses = []
            if not addresses and listed:
                raise MediaFetchError(f"media host {key!r} could not be resolved",
                                      hint="check the URL's host name",
                                      code="media_host_unresolvable")
        if not listed:
            kinds = [address_class(ipaddress.ip_address(text.split("%")[0]))
                     for text in addresses]
            if literal is not None and kinds[0] is not None:
                raise MediaPolicyError(
                    f"media host {key!r} is a {kinds[0]} address, which is refused",
                    hint="list the host in --allowed-media-domains to allow it",
                    code="media_private_address")
            if literal is None and (not addresses or any(kinds)):
                # One message whether the name does not resolve or resolves to a non-public
                # address: telling them apart would let any client map internal names.
                raise MediaPolicyError(
                    f"media host {key!r} does not resolve to a public address, which is "
                    "refused", code="media_private_address",
                    hint="check the host name; an internal host must be listed in "
                         "--allowed-media-domains")
        if literal is None:  # an address literal needs no pin: it is connected to as written
            self._pin(key, addresses)
        return addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        addresses = await self.check_host(host)
        results: list[ResolveResult] = []
        for text in addresses:
            ip = ipaddress.ip_address(text.split("%")[0])
            fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            if family not in (socket.AF_UNSPEC, fam) and family != 0:
                continue
            results.append(
                {"hostname": host, "host": str(ip), "port": port, "family": fam,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}
            )
        if not results:
            raise OSError(f"no usable address for {host}")
        return results

    async def close(self) -> None:
        self._pins.clear()

    def __repr__(self) -> str:  # keep addresses out of logs by default
        return f"PolicyResolver(pinned={len(self._pins)})"

