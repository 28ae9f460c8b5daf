"""Overload over real HTTP: past the bound on media bytes in flight, and past the bound on
requests fetching/decoding/preprocessing, a server answers 503 with Retry-After at once, gives
the bytes back when requests end, and serves normally afterwards."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from engine.media import synthetic
from tests.server_harness import MediaFiles, ServerProcess

pytestmark = pytest.mark.timeout(300)


def noise_png(side: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


def post(base: str, parts: list[dict] | str) -> tuple[int, dict, dict]:
    body = json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def in_flight_bytes(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    return float(re.search(r"^aphrodite_media_bytes_in_flight (\S+)$", text, re.M).group(1))


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_in_flight_bytes_and_decode_queue_bounds():
    big, small = noise_png(300, 1), noise_png(32, 2)  # ~270 kB and ~3 kB, incompressible
    host = MediaFiles({"/big.png": (big, "image/png"), "/small.png": (small, "image/png")},
                      stalls={"/big.png": 6.0, "/small.png": 6.0})
    server = ServerProcess("--allowed-media-domains", "127.0.0.1",
                           "--max-inflight-media-mb", "0.3", "--max-decode-queue", "2"
                           ).wait_ready()
    results: dict[str, tuple[int, dict, dict]] = {}
    inline = "data:image/png;base64," + base64.b64encode(noise_png(256, 3)).decode()

    def send(name: str, parts) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, post(server.base,
                                                                                  parts)))
        thread.start()
        return thread

    try:
        holder = send("holder", [image(f"{host.base}/big.png")])
        deadline = time.monotonic() + 30
        half = len(big) // 2
        while in_flight_bytes(server.base) < half and time.monotonic() < deadline:
            time.sleep(0.05)
        held = in_flight_bytes(server.base)
        assert half <= held < len(big)  # the first half arrived and is charged while it drips
        # ~135 kB held + ~197 kB inline > the 0.3 MB bound; the inline image alone fits
        status, headers, body = post(server.base, [image(inline)])
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "media_bytes_in_flight"
        assert "--max-inflight-media-mb" in body["error"]["message"]
        assert in_flight_bytes(server.base) == held  # the refused request gave its bytes back

        second = send("second", [image(f"{host.base}/small.png")])
        while host.hits["/small.png"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, headers, body = post(server.base, [image(f"{host.base}/small.png")])
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "decode_queue_full"
        assert "--max-decode-queue" in body["error"]["message"]
        assert host.hits["/small.png"] == 1  # refused before its fetch
        # A text-only request needs no decode-queue slot: served while the queue is full.
        status, _, body = post(server.base, "hello")
        assert status == 200, body

        holder.join(120)
        second.join(120)
        assert results["holder"][0] == 200 and results["second"][0] == 200
        assert in_flight_bytes(server.base) == 0
        assert post(server.base, [image(inline)])[0] == 200  # served normally afterwards
        assert in_flight_bytes(server.base) == 0
        # Bodies count too (charged from Content-Length before they are read): 0.35 MB of
        # text alone passes the 0.3 MB bound.
        status, _, body = post(server.base, "x" * 350_000)
        assert status == 503 and body["error"]["code"] == "media_bytes_in_flight", body
        assert in_flight_bytes(server.base) == 0
    finally:
        assert server.stop() == 0
        host.shutdown()


def test_fetch_slots_go_to_remote_media_only_and_waiting_counts_against_the_deadline():
    """With one fetch slot held by a slow video host: a data-URL image needs no slot and is
    answered; an http image waits at most its fetch timeout (1 s here) for the slot and then
    gets a 503 naming the flag, instead of waiting without end."""
    clip = synthetic.make_video(width=64, height=48, seconds=0.5)
    host = MediaFiles({"/slow.mp4": (clip, "video/mp4"), "/cat.png": (noise_png(32, 4),
                                                                       "image/png")},
                      stalls={"/slow.mp4": 8.0})
    server = ServerProcess("--allowed-media-domains", "127.0.0.1",
                           "--max-concurrent-fetches", "1",
                           env={"APHRODITE_IMAGE_FETCH_TIMEOUT": "1",
                                "APHRODITE_VIDEO_FETCH_TIMEOUT": "60"}).wait_ready()
    results: dict[str, tuple[int, dict, dict]] = {}
    try:
        holder = threading.Thread(target=lambda: results.__setitem__("holder", post(
            server.base, [{"type": "video_url", "video_url": {"url": f"{host.base}/slow.mp4"}}
                          ])))
        holder.start()
        deadline = time.monotonic() + 30
        while host.hits["/slow.mp4"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.hits["/slow.mp4"] == 1  # the slot is held while the video drips
        inline = "data:image/png;base64," + base64.b64encode(noise_png(32, 5)).decode()
        status, _, body = post(server.base, [image(inline)])
        assert status == 200, body
        status, headers, body = post(server.base, [image(f"{host.base}/cat.png")])
        assert status == 503 and headers["Retry-After"] == "1", body
        assert body["error"]["code"] == "fetch_slots_busy"
        assert "--max-concurrent-fetches" in body["error"]["message"]
        assert host.hits["/cat.png"] == 0
        holder.join(120)
        assert results["holder"][0] == 200, results["holder"]
        assert post(server.base, [image(f"{host.base}/cat.png")])[0] == 200
    finally:
        assert server.stop() == 0
        host.shutdown()
