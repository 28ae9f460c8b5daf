"""Overload over real HTTP: past the bound on media bytes in flight, and past the bound on
requests fetching/decoding/preprocessing, a server answers 503 with Retry-After at once, gives
the bytes back when requests end, and serves normally afterwards."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from tests.fixtures import MediaHost, synthetic
from tests.server_harness import ServerProcess

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
    host = MediaHost({"/big.png": (big, "image/png"), "/small.png": (small, "image/png")},
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
        host.stop()


def test_fetch_slots_go_to_remote_media_only_and_waiting_counts_against_the_deadline():
    """With one fetch slot held by a slow video host: a data-URL image needs no slot and is
    answered; an http image waits at most its fetch timeout (1 s here) for the slot and then
    gets a 503 naming the flag, instead of waiting without end."""
    clip = synthetic.make_video(width=64, height=48, seconds=0.5)
    host = MediaHost({"/slow.mp4": (clip, "video/mp4"), "/cat.png": (noise_png(32, 4),
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
        host.stop()


def post_from(source: str, base: str, parts: list[dict], forwarded_for: str | None = None
              ) -> tuple[int, dict]:
    """``post`` from another loopback address (all of 127/8 is this machine): a different
    client to the server, which tells clients apart by peer address (or, from a trusted
    proxy, by ``forwarded_for``)."""
    port = int(base.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120,
                                      source_address=(source, 0))
    forwarded = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    try:
        conn.request("POST", "/v1/chat/completions", headers={
            "Content-Type": "application/json", **forwarded}, body=json.dumps(
            {"max_tokens": 2, "messages": [{"role": "user", "content": parts}]}))
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_one_client_with_slow_media_hosts_holds_only_its_share_of_the_fetch_slots():
    """A client (127.0.0.2) sends three requests whose video hosts drip for 10 s: two hold its
    share (--max-fetches-per-client 2) and the third waits for it. Its image request then
    gets a 503 naming that flag once its 1 s fetch deadline passes, while another client's
    image gets one of the pool's free slots at once. Without the share the three videos and
    the image would all have had slots of the pool of four. Behind a trusted proxy
    (--trusted-proxies 127.0.0.9) a user is its X-Forwarded-For: the same client's image
    through the proxy waits for the same share, another user's is served; a peer that is
    not a trusted proxy cannot claim the client's address."""
    clip = synthetic.make_video(width=64, height=48, seconds=0.5)
    host = MediaHost({"/slow.mp4": (clip, "video/mp4"), "/cat.png": (noise_png(32, 4),
                                                                       "image/png")},
                      stalls={"/slow.mp4": 10.0})
    server = ServerProcess("--allowed-media-domains", "127.0.0.1",
                           "--max-concurrent-fetches", "4", "--max-fetches-per-client", "2",
                           "--trusted-proxies", "127.0.0.9",
                           env={"APHRODITE_IMAGE_FETCH_TIMEOUT": "1",
                                "APHRODITE_VIDEO_FETCH_TIMEOUT": "60"}).wait_ready()
    slow = [{"type": "video_url", "video_url": {"url": f"{host.base}/slow.mp4"}}]
    cat = [image(f"{host.base}/cat.png")]
    try:
        with ThreadPoolExecutor(3) as pool:
            videos = [pool.submit(post_from, "127.0.0.2", server.base, slow) for _ in range(3)]
            deadline = time.monotonic() + 60
            while host.hits["/slow.mp4"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # a third fetch, were it allowed, would have started by now
            assert host.hits["/slow.mp4"] == 2  # the client's share, not the pool's four
            status, body = post_from("127.0.0.2", server.base, cat)
            assert status == 503 and body["error"]["code"] == "fetch_slots_busy", body
            assert "--max-fetches-per-client" in body["error"]["message"]
            status, body = post_from("127.0.0.9", server.base, cat, "127.0.0.2")
            assert status == 503 and body["error"]["code"] == "fetch_slots_busy", body
            status, _, body = post(server.base, cat)  # another client: served at once
            assert status == 200, body
            for source, forwarded in (("127.0.0.9", "6.6.6.6, 198.51.100.7"),
                                      ("127.0.0.3", "127.0.0.2")):  # not a trusted proxy
                status, body = post_from(source, server.base, cat, forwarded)
                assert status == 200, body
            assert host.hits["/cat.png"] == 3
            # The waiting video gets the share when a drip ends (10 s), inside its deadline.
            assert [f.result()[0] for f in videos] == [200, 200, 200]
        assert host.hits["/slow.mp4"] == 3
    finally:
        assert server.stop() == 0
        host.stop()
