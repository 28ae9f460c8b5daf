"""HTTP media fetching against a real loopback server; hit counters prove what was fetched."""

from __future__ import annotations

from dataclasses import replace

import pytest
from yarl import URL

from engine.config import MediaLimits, MediaPolicy, ModalityLimits
from engine.errors import (
    AphroditeError,
    MediaFetchError,
    MediaPolicyError,
    MediaTooLargeError,
    UnsupportedMediaError,
)
from engine.media import addresses
from engine.media.connector import MediaConnector
from engine.media.http_fetch import HttpFetcher
from engine.media.inflight import InflightBytes, Ticket
from tests.media_server import MediaServer

#: A fetch deadline far longer than any of these tests needs. Tests whose refusal must come
#: *before* a body is read use it so that a fetch which waits for the body instead ends in
#: media_fetch_timeout (a different code) rather than racing the clock.
GENEROUS_TIMEOUT_S = 20.0


def small_image_limits(limits: MediaLimits, max_bytes: int, timeout: float = 5.0) -> MediaLimits:
    return replace(limits, image=ModalityLimits(max_bytes, timeout))


async def test_allowed_host_is_fetched_and_sniffed(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, limits) as c:
        media = await c.load_bytes(f"{media_server.base_url}/img.png", "image")
    assert media.mime == "image/png" and media.source == "http"
    assert media.data == media_server.files["/img.png"][0]
    assert media_server.hits["/img.png"] == 1


async def test_loopback_refused_without_allow_list_and_never_fetched(media_server, limits):
    async with MediaConnector(MediaPolicy.create(), limits) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(f"{media_server.base_url}/img.png", "image")
    assert info.value.code == "media_private_address"
    assert "--allowed-media-domains" in info.value.hint
    assert media_server.total_hits == 0


async def test_domain_not_on_allow_list_refused(media_server, limits):
    policy = MediaPolicy.create(allowed_domains=["media.example.com"])
    async with MediaConnector(policy, limits) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(f"{media_server.base_url}/img.png", "image")
    assert info.value.code == "media_domain_not_allowed"
    assert media_server.total_hits == 0


@pytest.mark.parametrize("spelling", ["127.1", "0x7f.1", "2130706433", "017700000001",
                                      "localhost", "[::ffff:127.0.0.1]", "127.0.0.1."])
async def test_loopback_spellings_refused(media_server, limits, spelling):
    port = media_server.base_url.rsplit(":", 1)[1]
    async with MediaConnector(MediaPolicy.create(), limits) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(f"http://{spelling}:{port}/img.png", "image")
    assert info.value.code == "media_private_address"
    assert media_server.total_hits == 0


async def test_name_resolving_to_private_address_refused_unless_listed(media_server, limits):
    port = media_server.base_url.rsplit(":", 1)[1]
    calls: list[str] = []

    async def fake_dns(host: str) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"]

    url = f"http://media.test:{port}/img.png"
    async with MediaConnector(MediaPolicy.create(), limits, lookup=fake_dns) as c:
        with pytest.raises(MediaPolicyError):
            await c.load_bytes(url, "image")
    assert media_server.total_hits == 0
    listed = MediaPolicy.create(allowed_domains=["MEDIA.test."])
    async with MediaConnector(listed, limits, lookup=fake_dns) as c:
        media = await c.load_bytes(url, "image")
    assert media.mime == "image/png" and media_server.hits["/img.png"] == 1


async def test_mixed_public_and_private_answers_refused(media_server, limits):
    async def fake_dns(host: str) -> list[str]:
        return ["93.184.216.34", "10.0.0.5"]

    async with MediaConnector(MediaPolicy.create(), limits, lookup=fake_dns) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.check("http://cdn.test/img.png", "image")
    assert info.value.code == "media_private_address"
    assert "does not resolve to a public address" in info.value.message


async def test_connection_goes_to_the_checked_address(media_server, limits):
    """A second, different DNS answer (rebinding) is never asked for: the pin is used."""
    port = media_server.base_url.rsplit(":", 1)[1]
    answers = [["127.0.0.1"], ["169.254.169.254"]]
    calls = 0

    async def rebinding_dns(host: str) -> list[str]:
        nonlocal calls
        calls += 1
        return answers[min(calls - 1, 1)]

    policy = MediaPolicy.create(allowed_domains=["rebind.test"])
    async with MediaConnector(policy, limits, lookup=rebinding_dns) as c:
        media = await c.load_bytes(f"http://rebind.test:{port}/img.png", "image")
    assert media.mime == "image/png"
    assert calls == 1


async def test_redirect_into_forbidden_host_refused(media_server, loopback_policy, limits):
    port = media_server.base_url.rsplit(":", 1)[1]
    url = f"{media_server.base_url}/redirect-to?to=http://localhost:{port}/img.png"
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(url, "image")
    assert info.value.code == "media_domain_not_allowed"
    assert media_server.hits["/redirect-to"] == 1 and media_server.hits["/img.png"] == 0


async def test_redirect_off_the_allow_list_refused_on_the_hop(media_server, limits):
    """With an allow-list, a redirect to a host that is not on it is refused on the hop."""
    port = media_server.base_url.rsplit(":", 1)[1]

    async def fake_dns(host: str) -> list[str]:
        return ["127.0.0.1"]

    policy = MediaPolicy.create(allowed_domains=["start.test"])
    url = f"http://start.test:{port}/redirect-to?to=http://127.0.0.1:{port}/img.png"
    async with MediaConnector(policy, limits, lookup=fake_dns) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(url, "image")
    assert info.value.code == "media_domain_not_allowed"
    assert media_server.hits["/redirect-to"] == 1 and media_server.hits["/img.png"] == 0


PUBLIC_STAND_IN = "127.0.0.2"


@pytest.fixture
def public_media_server(monkeypatch):
    """A media server on 127.0.0.2 that the policy judges public.

    Linux routes all of 127/8 to the loopback interface, so the server is reachable; only
    127.0.0.2 is reclassified, every other address is judged by the real rules. This lets a
    test run without an allow-list (which would refuse private hops for another reason).
    """
    real = addresses.address_class
    monkeypatch.setattr(addresses, "address_class",
                        lambda ip: None if str(ip) == PUBLIC_STAND_IN else real(ip))
    host = MediaServer(host=PUBLIC_STAND_IN)
    yield host
    host.stop()


async def test_public_stand_in_is_fetched_without_allow_list(public_media_server, limits):
    """The control for the test below: the 127.0.0.2 stand-in passes the policy as public."""
    async with MediaConnector(MediaPolicy.create(), limits) as c:
        media = await c.load_bytes(f"{public_media_server.base_url}/img.png", "image")
    assert media.mime == "image/png" and public_media_server.hits["/img.png"] == 1


@pytest.mark.parametrize("target_host", ["127.0.0.1", "[::ffff:127.0.0.1]", "[::1]",
                                         "localhost"])
async def test_redirect_to_private_address_refused_on_the_hop(
    public_media_server, media_server, limits, target_host
):
    """No allow-list: the first host is public, its redirect points at a loopback server.

    aiohttp connects to an IP-literal host without asking the resolver, so for the literal
    targets the per-hop check in the fetcher is the only thing between the redirect and the
    private host. For a name (``localhost``) aiohttp's call to the policy resolver is a second
    line of defence that refuses with the same code.
    """
    png = media_server.files["/img.png"]
    media_server.files["/secret"] = png  # would be a valid image, were it ever fetched
    port = media_server.base_url.rsplit(":", 1)[1]
    url = f"{public_media_server.base_url}/redirect-to?to=http://{target_host}:{port}/secret"
    async with MediaConnector(MediaPolicy.create(), replace(limits, fetch_retries=0)) as c:
        with pytest.raises(AphroditeError) as info:
            await c.load_bytes(url, "image")
    assert (info.value.code, info.value.status) == ("media_private_address", 400), info.value
    assert public_media_server.hits["/redirect-to"] == 1  # refused on the hop, not before
    assert media_server.hits["/secret"] == 0


@pytest.mark.parametrize("target", ["file:///etc/passwd", "data:image/png;base64,AAAA",
                                    "ftp://127.0.0.1/x.png"])
async def test_redirect_to_other_schemes_refused(media_server, loopback_policy, limits, target):
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(MediaPolicyError) as info:
            await c.load_bytes(f"{media_server.base_url}/redirect-to?to={target}", "image")
    assert info.value.code == "media_scheme_not_allowed"


async def test_redirects_are_bounded(media_server, limits):
    policy = MediaPolicy.create(allowed_domains=["127.0.0.1"], max_redirects=3)
    async with MediaConnector(policy, limits) as c:
        media = await c.load_bytes(f"{media_server.base_url}/redirect/2", "image")
        assert media.redirects == 3
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"{media_server.base_url}/redirect/3", "image")
    assert info.value.code == "media_too_many_redirects"
    assert "APHRODITE_MEDIA_MAX_REDIRECTS" in info.value.hint


async def test_body_over_cap_refused_413_with_hint(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, small_image_limits(limits, 100_000)) as c:
        with pytest.raises(MediaTooLargeError) as info:
            await c.load_bytes(f"{media_server.base_url}/big?size=200000", "image")
        ok = await c.load_bytes(f"{media_server.base_url}/big?size=90000", "image")
    assert info.value.status == 413 and "APHRODITE_MAX_IMAGE_BYTES" in info.value.hint
    assert ok.size == 90_000


async def test_content_length_over_cap_refused_before_reading(media_server, limits):
    """The headers claim cap+1 bytes and the body never comes: only a check of
    Content-Length can refuse it. A fetch that waited for the body would instead end, after
    GENEROUS_TIMEOUT_S, in media_fetch_timeout."""
    cap = 100_000
    policy = MediaPolicy.create(allowed_domains=["127.0.0.1"])
    fetch_limits = small_image_limits(limits, cap, GENEROUS_TIMEOUT_S)
    async with MediaConnector(policy, fetch_limits) as c:
        with pytest.raises(AphroditeError) as info:
            await c.load_bytes(f"{media_server.base_url}/headers-only?claimed={cap + 1}",
                               "image")
    assert (info.value.code, info.value.status) == ("media_too_large", 413), info.value
    assert media_server.hits["/headers-only"] == 1


BOUNDARY_CAP = 100_003  # not a multiple of the 64 KiB read chunk


@pytest.mark.parametrize("route", ["big", "chunked"])  # with and without Content-Length
@pytest.mark.parametrize("size", [BOUNDARY_CAP, BOUNDARY_CAP + 1])
async def test_cap_is_exact(media_server, loopback_policy, limits, route, size):
    """A body of exactly the cap is accepted, one byte more is refused."""
    fetcher = HttpFetcher(loopback_policy, small_image_limits(limits, BOUNDARY_CAP))
    url = URL(f"{media_server.base_url}/{route}?size={size}")
    try:
        if size <= BOUNDARY_CAP:
            result = await fetcher.fetch(url, "image")
            assert len(result.data) == size
        else:
            with pytest.raises(AphroditeError) as info:
                await fetcher.fetch(url, "image")
            assert info.value.code == "media_too_large", info.value
    finally:
        await fetcher.close()
    assert media_server.hits[f"/{route}"] == 1


class PeakTicket(Ticket):
    """A ticket that remembers the most bytes it ever held."""

    peak = 0

    def charge(self, nbytes: int) -> None:
        super().charge(nbytes)
        self.peak = max(self.peak, self.held)


async def test_over_cap_chunked_body_refused_while_streaming(media_server, loopback_policy,
                                                             limits):
    """A chunked body 50x over the cap is refused before it is buffered: the fetch never
    holds more than the cap plus one 64 KiB read, and gives back what it held."""
    cap = 200_000
    budget = InflightBytes(limit_bytes=1 << 40)  # the bound itself is not under test here
    ticket = PeakTicket(budget)
    fetcher = HttpFetcher(loopback_policy, small_image_limits(limits, cap, GENEROUS_TIMEOUT_S))
    try:
        with pytest.raises(AphroditeError) as info:
            await fetcher.fetch(URL(f"{media_server.base_url}/chunked?size={50 * cap}"),
                                "image", ticket=ticket)
    finally:
        await fetcher.close()
    assert info.value.code == "media_too_large", info.value
    assert 0 < ticket.peak <= cap + 64 * 1024, f"held {ticket.peak} bytes, cap {cap}"
    assert ticket.held == 0 and budget.in_use == 0


async def test_a_refused_fetch_gives_back_only_its_own_bytes(media_server, loopback_policy,
                                                             limits):
    """The ticket is the whole request's: another item's bytes already on it stay charged
    when this fetch is refused over the cap (it refunds what it charged, not what it read)."""
    cap = 200_000
    budget = InflightBytes(limit_bytes=1 << 40)
    ticket = budget.ticket()
    ticket.charge(100_000)  # an earlier item of the same request, still held
    fetcher = HttpFetcher(loopback_policy, small_image_limits(limits, cap, GENEROUS_TIMEOUT_S))
    try:
        with pytest.raises(MediaTooLargeError):
            await fetcher.fetch(URL(f"{media_server.base_url}/chunked?size={50 * cap}"),
                                "image", ticket=ticket)
    finally:
        await fetcher.close()
    assert ticket.held == 100_000 and budget.in_use == 100_000


async def test_compressed_body_counted_after_decompression(media_server, loopback_policy,
                                                           limits):
    """A gzip bomb is counted as it decompresses: refused at the cap, never held whole."""
    cap = 1_000_000
    budget = InflightBytes(limit_bytes=1 << 40)
    ticket = PeakTicket(budget)
    fetcher = HttpFetcher(loopback_policy, small_image_limits(limits, cap))
    try:
        with pytest.raises(MediaTooLargeError):
            await fetcher.fetch(URL(f"{media_server.base_url}/gzip-bomb?size=64000000"),
                                "image", ticket=ticket)
    finally:
        await fetcher.close()
    assert ticket.peak <= cap + 64 * 1024, f"held {ticket.peak} bytes, cap {cap}"


async def test_lying_content_length_is_a_fetch_error(media_server, limits):
    policy = MediaPolicy.create(allowed_domains=["127.0.0.1"])
    async with MediaConnector(policy, limits) as c:
        with pytest.raises(MediaFetchError) as info:  # claims 5000 bytes, sends 80
            await c.load_bytes(f"{media_server.base_url}/lying?claimed=5000&repeat=10",
                               "image")
    assert "broken body" in info.value.message
    # a broken body is retried, boundedly
    assert media_server.hits["/lying"] == limits.fetch_retries + 1


async def test_slow_server_hits_the_total_deadline(media_server, loopback_policy, limits):
    """The deadline covers the whole fetch: the timed-out attempt is not retried."""
    async with MediaConnector(loopback_policy, small_image_limits(limits, 10**6, 1.0)) as c:
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"{media_server.base_url}/slow?every=0.2", "image")
    assert info.value.code == "media_fetch_timeout"
    assert "APHRODITE_IMAGE_FETCH_TIMEOUT" in info.value.hint
    assert media_server.hits["/slow"] == 1


async def test_5xx_is_retried_within_the_deadline(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, replace(limits, fetch_retries=2)) as c:
        media = await c.load_bytes(f"{media_server.base_url}/flaky", "image")
    assert media.attempts == 3 and media_server.hits["/flaky"] == 3


async def test_retries_are_bounded(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, replace(limits, fetch_retries=1)) as c:
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"{media_server.base_url}/status/503", "image")
    assert "503" in info.value.message and media_server.hits["/status/503"] == 2


async def test_4xx_is_not_retried(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"{media_server.base_url}/status/404", "image")
    assert info.value.code == "media_fetch_status" and media_server.hits["/status/404"] == 1


async def test_connection_refused_is_a_client_error(loopback_policy, limits):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    async with MediaConnector(loopback_policy, replace(limits, fetch_retries=0)) as c:
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"http://127.0.0.1:{port}/img.png", "image")
    assert info.value.status == 400 and "connected" in info.value.message


async def test_proxy_environment_is_ignored(media_server, aiohttp_server, loopback_policy,
                                            limits, monkeypatch):
    from aiohttp import web

    proxied = []

    async def proxy(request):
        proxied.append(request.path)
        return web.Response(status=502)

    proxy_app = web.Application()
    proxy_app.router.add_route("*", "/{p:.*}", proxy)
    proxy_server = await aiohttp_server(proxy_app)
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy_server.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with MediaConnector(loopback_policy, limits) as c:
        media = await c.load_bytes(f"{media_server.base_url}/img.png", "image")
    assert media.mime == "image/png" and proxied == []


async def test_html_sent_as_image_is_unsupported_media(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(UnsupportedMediaError) as info:
            await c.load_bytes(f"{media_server.base_url}/page.html", "image")
    assert (info.value.status, info.value.code) == (400, "unsupported_media_type")


async def test_declared_type_is_only_a_hint(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, limits) as c:
        media = await c.load_bytes(f"{media_server.base_url}/mislabelled.png", "image")
    assert media.declared_mime == "image/png" and media.mime == "image/jpeg"


async def test_one_bad_item_refuses_the_request_before_any_fetch(media_server, loopback_policy,
                                                                 limits):
    items = [(f"{media_server.base_url}/img.png", "image"),
             ("http://169.254.169.254/latest/meta-data", "image")]
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(MediaPolicyError):
            await c.check_all(items)
    assert media_server.total_hits == 0
