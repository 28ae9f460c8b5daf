"""HTTP media fetching against a real loopback server; hit counters prove what was fetched."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from engine.config import MediaLimits, MediaPolicy, ModalityLimits
from engine.errors import (
    MediaFetchError,
    MediaPolicyError,
    MediaTooLargeError,
    UnsupportedMediaError,
)
from engine.media.connector import MediaConnector
from tests.media_server import start_lying_server


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
    assert "private" in info.value.message


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


async def test_redirect_to_private_address_refused_on_the_hop(media_server, limits):
    """No allow-list: the first host is public (fake DNS), the redirect goes to loopback."""
    port = media_server.base_url.rsplit(":", 1)[1]

    async def fake_dns(host: str) -> list[str]:
        return ["127.0.0.1"]

    policy = MediaPolicy.create(allowed_domains=["start.test"])
    url = f"http://start.test:{port}/redirect-to?to=http://127.0.0.1:{port}/img.png"
    async with MediaConnector(policy, limits, lookup=fake_dns) as c:
        with pytest.raises(MediaPolicyError):
            await c.load_bytes(url, "image")
    assert media_server.hits["/img.png"] == 0


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


async def test_content_length_over_cap_refused(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, small_image_limits(limits, 100_000)) as c:
        with pytest.raises(MediaTooLargeError) as info:
            await c.load_bytes(f"{media_server.base_url}/big?size=200000", "image")
        ok = await c.load_bytes(f"{media_server.base_url}/big?size=90000", "image")
    assert info.value.status == 413 and "APHRODITE_MAX_IMAGE_BYTES" in info.value.hint
    assert ok.size == 90_000


async def test_chunked_body_over_cap_refused_while_streaming(media_server, loopback_policy,
                                                             limits):
    async with MediaConnector(loopback_policy, small_image_limits(limits, 200_000)) as c:
        with pytest.raises(MediaTooLargeError):
            await c.load_bytes(f"{media_server.base_url}/chunked?size=50000000", "image")


async def test_compressed_body_counted_after_decompression(media_server, loopback_policy,
                                                           limits):
    async with MediaConnector(loopback_policy, small_image_limits(limits, 1_000_000)) as c:
        with pytest.raises(MediaTooLargeError):
            await c.load_bytes(f"{media_server.base_url}/gzip-bomb?size=64000000", "image")


async def test_lying_content_length_is_a_fetch_error(limits):
    server, port, hits = await start_lying_server(claimed=5000, sent=b"\x89PNG\r\n\x1a\n" * 10)
    async with server:
        policy = MediaPolicy.create(allowed_domains=["127.0.0.1"])
        async with MediaConnector(policy, limits) as c:
            with pytest.raises(MediaFetchError) as info:
                await c.load_bytes(f"http://127.0.0.1:{port}/x.png", "image")
    assert "broken body" in info.value.message
    assert hits["/"] == limits.fetch_retries + 1  # a broken body is retried, boundedly


async def test_slow_server_hits_the_total_deadline(media_server, loopback_policy, limits):
    start = time.monotonic()
    async with MediaConnector(loopback_policy, small_image_limits(limits, 10**6, 1.0)) as c:
        with pytest.raises(MediaFetchError) as info:
            await c.load_bytes(f"{media_server.base_url}/slow?every=0.2", "image")
    assert info.value.code == "media_fetch_timeout"
    assert "APHRODITE_IMAGE_FETCH_TIMEOUT" in info.value.hint
    assert time.monotonic() - start < 4.0


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


async def test_html_sent_as_image_is_415(media_server, loopback_policy, limits):
    async with MediaConnector(loopback_policy, limits) as c:
        with pytest.raises(UnsupportedMediaError) as info:
            await c.load_bytes(f"{media_server.base_url}/page.html", "image")
    assert info.value.status == 415


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
