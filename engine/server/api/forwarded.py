"""The client behind a trusted reverse proxy (``--trusted-proxies``).

Behind a reverse proxy, a load balancer or an ingress every user reaches the server from the
proxy's address, so per-client shares (the fetch slots, ``--max-fetches-per-client``, and the
decode queue's) would make all of them one client. A request whose peer is in a trusted
network is counted as the right-most address of its ``X-Forwarded-For`` that is not itself
trusted: each proxy appends the address it received the request from, so what a client wrote
further left is never believed. Any other request, or one without a usable header, is its
peer's (a client cannot claim another address by sending the header itself). Connection caps
(:mod:`engine.server.api.connections`) still count peers: a connection is the proxy's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from engine.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.strip().split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class TrustedProxies:
    """The networks whose ``X-Forwarded-For`` is believed (none: nobody's)."""

    def __init__(self, networks: Sequence[str] | None = ()) -> None:
        self.networks: list[Network] = []
        for text in networks or ():
            try:
                self.networks.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                raise ConfigError(
                    f"--trusted-proxies {text!r} is not an IP address or network",
                    hint="give addresses or CIDR networks, e.g. 10.0.0.0/8,127.0.0.1",
                    code="invalid_flag") from None

    def trusted(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
        return ip is not None and any(ip in net for net in self.networks)

    def client(self, peer: str | None, forwarded_for: Iterable[str] = ()) -> str | None:
        """The address a request is counted as: see the module docstring."""
        if not self.trusted(_address(peer or "")):
            return peer
        hops = [hop for header in forwarded_for for hop in header.split(",")]
        for hop in reversed(hops):
            ip = _address(hop)
            if ip is None:
                break  # a malformed hop: nothing left of it is believed
            if not self.trusted(ip):
                return str(ip)
        return peer
