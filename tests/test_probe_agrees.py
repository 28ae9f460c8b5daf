"""`aphrodite media probe` refuses and accepts exactly as the serving path's connector does."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from engine.config import MediaPolicy
from engine.errors import AphroditeError
from engine.media import synthetic
from engine.media.connector import MediaConnector
from engine.media.image import decode_image

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
    # The table covers acceptance and several distinct refusals, not one answer repeated.
    assert outcomes.count("ok") == 3 and len(set(outcomes)) >= 6
