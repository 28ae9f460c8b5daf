"""Address classification and the resolver that enforces it."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.config import MediaPolicy
from engine.errors import MediaFetchError, MediaPolicyError
from engine.media.addresses import PolicyResolver, address_class

FORBIDDEN = ["127.0.0.1", "127.255.0.9", "10.1.2.3", "172.16.0.1", "192.168.1.1",
             "169.254.169.254", "100.64.0.1", "100.127.255.254", "0.0.0.0", "224.0.0.1",
             "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1", "ff02::1",
             "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
             "2002:7f00:1::", "::127.0.0.1", "192.0.2.1", "198.18.0.1"]
PUBLIC = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("text", FORBIDDEN)
def test_forbidden_addresses(text):
    assert address_class(ipaddress.ip_address(text)) is not None


@pytest.mark.parametrize("text", PUBLIC)
def test_public_addresses(text):
    assert address_class(ipaddress.ip_address(text)) is None


def test_metadata_and_cgnat_are_named():
    assert "metadata" in address_class(ipaddress.ip_address("169.254.169.254"))
    assert address_class(ipaddress.ip_address("100.64.1.1")) == "CGNAT"


private_v4 = st.sampled_from(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8",
                              "169.254.0.0/16", "100.64.0.0/10"]).flatmap(
    lambda net: st.integers(0, ipaddress.ip_network(net).num_addresses - 1).map(
        lambda i, n=net: ipaddress.ip_network(n)[i]))


@given(private_v4)
def test_every_private_v4_is_forbidden_in_both_spellings(ip):
    assert address_class(ip) is not None
    assert address_class(ipaddress.IPv6Address(f"::ffff:{ip}")) is not None


async def test_resolver_refuses_private_answers_unless_listed():
    async def dns(host):
        return ["10.0.0.7"]

    with pytest.raises(MediaPolicyError) as info:
        await PolicyResolver(MediaPolicy.create(), dns).check_host("internal.test")
    assert info.value.code == "media_private_address"
    listed = PolicyResolver(MediaPolicy.create(allowed_domains=["internal.test"]), dns)
    assert await listed.check_host("internal.test") == ["10.0.0.7"]


async def test_resolver_gives_aiohttp_the_checked_addresses():
    async def dns(host):
        return ["93.184.216.34"]

    resolver = PolicyResolver(MediaPolicy.create(), dns)
    results = await resolver.resolve("cdn.test", 443)
    assert [r["host"] for r in results] == ["93.184.216.34"] and results[0]["port"] == 443


async def test_an_unlisted_name_gets_one_message_whether_or_not_it_resolves():
    """Telling "does not resolve" from "resolves to a private address" would let any client
    map the internal names of the server's network: both get the same code, status and
    message (only the host differs). A listed host is the operator's, and is told apart."""
    async def dns(host):
        if host == "intranet.test":
            return ["10.1.2.3"]
        raise OSError("Name or service not known")

    resolver = PolicyResolver(MediaPolicy.create(), dns)
    refusals = []
    for host in ("intranet.test", "nowhere.test"):
        with pytest.raises(MediaPolicyError) as info:
            await resolver.check_host(host)
        err = info.value
        refusals.append((err.status, err.code, str(err).replace(host, "HOST"), err.hint))
    assert refusals[0] == refusals[1]
    assert refusals[0][:2] == (400, "media_private_address")
    assert "--allowed-media-domains" in refusals[0][3]

    listed = PolicyResolver(MediaPolicy.create(allowed_domains=["nowhere.test"]), dns)
    with pytest.raises(MediaFetchError) as info:
        await listed.check_host("nowhere.test")
    assert info.value.status == 400 and info.value.code == "media_host_unresolvable"


@pytest.mark.parametrize(("address", "verdict"), [
    ("64:ff9b::7f00:1", "loopback"), ("64:ff9b::a00:1", "private"),
    ("64:ff9b::a9fe:a9fe", "link-local (cloud metadata)"), ("64:ff9b::808:808", None)])
def test_nat64_addresses_are_judged_by_the_ipv4_address_inside(address, verdict):
    """A NAT64 gateway (RFC 6052, 64:ff9b::/96) connects to the embedded IPv4 address. On an
    IPv6-only network with DNS64 every IPv4-only media host resolves to such an address, so
    refusing the whole prefix (Python calls it reserved) would refuse every such host."""
    assert address_class(ipaddress.IPv6Address(address)) == verdict


async def test_the_pin_table_is_bounded():
    """Requests naming many distinct hosts or address literals cannot grow the resolver's
    memory without end: literals are never pinned, names are capped and expire."""
    asked: list[str] = []

    async def dns(host):
        asked.append(host)
        return ["93.184.216.34"]

    resolver = PolicyResolver(MediaPolicy.create(), dns, ttl_s=30)
    resolver.MAX_PINS = 50
    for i in range(200):
        await resolver.check_host(f"8.8.{i // 250}.{i % 250}")
    assert resolver.pinned == 0 and asked == []  # literals: checked, not looked up or kept
    for i in range(200):
        await resolver.check_host(f"host{i}.test")
    assert resolver.pinned == 50
    await resolver.check_host("host199.test")  # the newest are kept: no second lookup
    assert asked.count("host199.test") == 1
    await resolver.check_host("host0.test")  # the oldest went: looked up again
    assert asked.count("host0.test") == 2
    expired = PolicyResolver(MediaPolicy.create(), dns, ttl_s=0)
    for i in range(20):
        await expired.check_host(f"host{i}.test")
    assert expired.pinned <= 1  # an expired entry is dropped when the next one comes
