"""`aphrodite media probe` refuses and accepts exactly as the serving path's connector does."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from engine.config import MediaPolicy
from engine.errors import AphroditeError
from engine.media.connector import MediaConnector
from engine.media.image import decode_image
from tests.fixtures import synthetic

BIN = Path(sys.executable).with_name("aphrodite")


async def probe_cli(source: str, *flags: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "media", "probe", source, "--modality", "image", "--json", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    report = json.loads(out)
    assert proc.returncode == (0 if report["ok"] else 1), err.decode()
    return report


async def connector_outcome(source: str, policy: MediaPolicy, limits) -> str:
    try:
        async with MediaConnector(policy, limits) as c:
            decode_image((await c.load_bytes(source, "image")).data, limits)
    except AphroditeError as err:
        return err.code
    return "ok"


async def test_probe_and_connector_agree(media_server, limits, tmp_path):
    (tmp_path / "a.png").write_bytes(synthetic.make_image(20, 10, fmt="PNG"))
    (tmp_path / "cut.jpg").write_bytes(synthetic.make_image(300, 300, fmt="JPEG")[:3000])
    base = media_server.base_url
    port = base.rsplit(":", 1)[1]
    cases = [
        (f"{base}/img.png", ["--allowed-media-domains", "127.0.0.1"]),
        (f"{base}/img.png", []),
        (f"http://localhost:{port}/img.png", ["--allowed-media-domains", "127.0.0.1"]),
        (f"{base}/redirect-to?to=http://localhost:{port}/img.png",
         ["--allowed-media-domains", "127.0.0.1,localhost"]),
        (f"{base}/page.html", ["--allowed-media-domains", "127.0.0.1"]),
        (f"file://{tmp_path}/a.png", ["--allowed-local-media-path", str(tmp_path)]),
        (f"file://{tmp_path}/cut.jpg", ["--allowed-local-media-path", str(tmp_path)]),
        (f"file://{tmp_path}/a.png", []),
        ("gopher://example.com/a.png", []),
    ]
    # What each case must give, worked out by hand from the policy's rules.
    expected_codes = ["ok", "media_private_address", "media_domain_not_allowed", "ok",
                      "unsupported_media_type", "ok", "media_decode_failed",
                      "media_local_path_disabled", "media_scheme_not_allowed"]
    outcomes = []
    for source, flags in cases:
        report = await probe_cli(source, *flags)
        domains = []
        local = None
        if "--allowed-media-domains" in flags:
            domains = flags[flags.index("--allowed-media-domains") + 1].split(",")
        if "--allowed-local-media-path" in flags:
            local = flags[flags.index("--allowed-local-media-path") + 1]
        policy = MediaPolicy.create(allowed_domains=domains, allowed_local_path=local)
        expected = await connector_outcome(source, policy, limits)
        got = "ok" if report["ok"] else report["error"]["code"]
        outcomes.append(got)
        assert got == expected, (source, flags)
    assert outcomes == expected_codes


# Hosts spelled every way a URL may spell a non-public address, and public ones, each with the
# allow-list it is checked under. The verdict expected is not taken from the product: see
# `oracle_verdict`.
HOSTS = [
    ("127.0.0.1", []), ("127.1", []), ("0x7f.1", []), ("2130706433", []),
    ("0177.0.0.1", []), ("0x7f000001", []), ("[::ffff:127.0.0.1]", []),
    ("[::ffff:7f00:1]", []), ("[::127.0.0.1]", []), ("[::1]", []), ("localhost", []),
    ("LocalHost.", []), ("0", []), ("[::]", []), ("10.1", []), ("192.168.1.1", []),
    ("172.16.0.1", []), ("169.254.169.254", []), ("2852039166", []),
    ("[::ffff:169.254.169.254]", []), ("100.64.0.1", []), ("100.127.255.254", []),
    ("224.0.0.1", []), ("240.0.0.1", []), ("[fe80::1]", []), ("[fc00::1]", []),
    ("[ff02::1]", []), ("[2002:7f00:1::]", []), ("198.18.0.1", []),
    ("[64:ff9b::7f00:1]", []), ("[64:ff9b::a9fe:a9fe]", []), ("nowhere.invalid", []),
    # public
    ("8.8.8.8", []), ("1.1.1.1", []), ("[2606:4700:4700::1111]", []),
    ("[::ffff:8.8.8.8]", []), ("100.128.0.1", []), ("11.0.0.1", []),
    ("[64:ff9b::808:808]", []),
    # the operator's allow-list: a listed host is fetched whatever it resolves to; any other
    # host is refused for not being listed, before its address is looked at
    ("localhost", ["localhost"]), ("LOCALHOST", ["localhost."]), ("127.1", ["127.1"]),
    ("169.254.169.254", ["169.254.169.254"]), ("127.0.0.1", ["localhost"]),
    ("8.8.8.8", ["localhost"]),
]


def forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not a public unicast address. An IPv6 address that carries an IPv4 one (IPv4-mapped
    ::ffff:a.b.c.d; 6to4 2002:AABB:CCDD::) is judged by the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return forbidden(ip.ipv4_mapped)
        if ip in ipaddress.ip_network("2002::/16"):
            return forbidden(ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF))
        if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64 (RFC 6052)
            return forbidden(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
            or ip.is_reserved or ip.is_unspecified or not ip.is_global)


def oracle_verdict(url: str, allowed: list[str]) -> str:
    """The check's verdict from first principles: the host as urllib reads it, the system
    resolver's addresses for it, and Python's `ipaddress` classes."""
    host = urlsplit(url).hostname.rstrip(".")  # lower case, no brackets
    listed = {name.lower().strip("[]").rstrip(".") for name in allowed}
    if listed and host not in listed:
        return "media_domain_not_allowed"
    if host in listed:
        return "ok"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        # Unlisted: the same answer as a private address (no oracle for internal names).
        return "media_private_address"
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    return "media_private_address" if any(forbidden(a) for a in addresses) else "ok"


async def connector_verdict(url: str, allowed: list[str]) -> str:
    """What the serving path's connector decides before fetching anything."""
    try:
        async with MediaConnector(MediaPolicy.create(allowed_domains=allowed)) as connector:
            await connector.check(url, "image")
    except AphroditeError as err:
        return err.code
    return "ok"


async def test_connector_refuses_exactly_the_hosts_that_resolve_to_non_public_addresses():
    urls = [(f"http://{host}/x.png", allowed) for host, allowed in HOSTS]
    expected = [oracle_verdict(url, allowed) for url, allowed in urls]
    # The table is not one answer repeated: refusals by address and by allow-list, and
    # acceptances (public addresses, listed hosts).
    assert expected.count("media_private_address") >= 25
    assert expected.count("media_domain_not_allowed") == 2 and expected.count("ok") >= 9
    got = [await connector_verdict(url, allowed) for url, allowed in urls]
    assert [(u, g) for (u, _), g in zip(urls, got, strict=True)] == \
        [(u, e) for (u, _), e in zip(urls, expected, strict=True)]


@pytest.mark.parametrize("host", ["127.1", "0x7f.1", "2130706433", "[::ffff:127.0.0.1]",
                                  "localhost", "169.254.169.254", "100.64.0.1"])
async def test_probe_refuses_every_spelling_of_a_non_public_host(host):
    url = f"http://{host}/x.png"
    assert oracle_verdict(url, []) == "media_private_address"
    report = await probe_cli(url)
    assert not report["ok"] and report["error"]["code"] == "media_private_address"
    assert report["bytes"] is None  # refused before any fetch


def test_probe_scans_a_video_once_and_takes_the_checked_video_options(monkeypatch):
    """`media probe` reports the container facts and decodes what the server would from one
    scan of the clip, with the video options the command checked (not parsed again)."""
    import base64

    from engine.config import MediaLimits
    from engine.media import probe
    from engine.media.video import info, loader
    from engine.media.video.options import server_video_spec

    scans = []
    real = probe.scan_video
    for module in (probe, info, loader):  # every place a scan could come from
        monkeypatch.setattr(module, "scan_video", lambda *a: scans.append(1) or real(*a))
    clip = synthetic.make_video(width=64, height=48, seconds=1)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    video = server_video_spec({"video": {"backend": "pyav", "num_frames": 3}})
    report = asyncio.run(probe.probe_source(url, "video", MediaPolicy.create(),
                                            MediaLimits.from_env(), video=video))
    assert report.ok, report.error
    assert scans == [1]
    assert report.details["counted_frames"] == 30
    assert report.sent_to_model["frames"] == 3 and report.sent_to_model["backend"] == "pyav"
