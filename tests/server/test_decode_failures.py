"""A decoder failure of any exception type is that item's 4xx, in both isolation modes: the
decode worker survives (no restart) and the in-process path answers 422, not 500.

The hostile files are real: a DDS header with pixel-format flags Pillow does not implement
(``NotImplementedError``), and byte-mutated MP3 audio and MP4 video found, by a seeded search
(``hostile_media.foreign_failure``, which the soak's catalogue uses too), to make PyAV or the
scan raise something other than the project's own errors (``ValueError``,
``UnicodeDecodeError``, ``AttributeError``, ``InvalidDataError``).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Callable

import pytest

from engine.config import MediaLimits
from engine.errors import ConfigError, MediaDecodeError
from engine.media.audio import decode_audio
from engine.media.image import decode_image
from engine.media.isolation import DecodeWorkers
from engine.media.video.options import build_spec
from engine.processing.media_items import InProcessDecoders
from tests.fixtures import hostile_media, synthetic
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)
LIMITS = MediaLimits.from_env()


def foreign_failure(base: bytes, decode: Callable[[bytes], object],
                    seed: int) -> tuple[bytes, str]:
    try:
        return hostile_media.foreign_failure(base, decode, seed)
    except LookupError:
        pytest.fail("no mutation made the decoder raise a foreign exception")


def spec():
    """What the foreign-failure video was searched with (one decoding thread: FFmpeg's frame
    threads may drop a corrupt frame instead of raising, by timing)."""
    return build_spec(dict(hostile_media.FOREIGN_VIDEO_IO), "pyav", error=ConfigError)


@pytest.fixture(scope="module")
def hostile() -> dict[str, tuple[bytes, str]]:
    mp3 = synthetic.make_audio(seconds=1, fmt="mp3")
    dds = hostile_media.dds_with_unknown_pixel_format()
    with pytest.raises(NotImplementedError):
        decode_image(dds, LIMITS)  # the raw decoder's own failure, before any wrapping
    return {
        "image": (dds, "NotImplementedError"),
        "video": hostile_media.foreign_failure_video(seed=1),
        "audio": foreign_failure(mp3, lambda d: decode_audio(d, max_seconds=600), seed=1),
    }


def _decode(decoders, modality: str, data: bytes):
    if modality == "image":
        return decoders.decode_image(data, LIMITS)
    if modality == "video":
        return decoders.decode_video(data, spec(), LIMITS)
    return decoders.decode_audio(data, sampling_rate=16_000, max_seconds=600)


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_a_foreign_exception_is_a_422_and_the_worker_lives(hostile, modality):
    data, raised = hostile[modality]
    pool = DecodeWorkers(1, timeout_s=60)
    try:
        before = pool.pids()
        with pytest.raises(MediaDecodeError) as info:
            _decode(pool, modality, data)
        assert info.value.status == 422 and info.value.code == "media_decode_failed"
        assert raised in info.value.message
        assert pool.restarts == 0 and pool.pids() == before
        # the same worker decodes a valid file next
        assert _decode(pool, "image", synthetic.make_image(32, 32)).size == (32, 32)
    finally:
        pool.close()


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_in_process_decoding_turns_foreign_exceptions_into_422(hostile, modality):
    data, _ = hostile[modality]
    with pytest.raises(MediaDecodeError) as info:
        _decode(InProcessDecoders(), modality, data)
    assert info.value.status == 422



async def test_the_async_gpu_decode_path_turns_foreign_exceptions_into_422(hostile):
    """The API server's own decode path for GPU backends (``load_video_async``, holding the
    GPU decode budget) maps a decoder's foreign exception as the workers do; run here with a
    CPU backend and a real budget, since the mapping is the backend's caller's."""
    from engine.media.video import load_video_async
    from engine.media.video.budget import GpuDecodeBudget

    data, _ = hostile["video"]
    with pytest.raises(MediaDecodeError) as info:
        await load_video_async(data, spec(), LIMITS, GpuDecodeBudget(1 << 30))
    assert info.value.status == 422 and info.value.code == "media_decode_failed"
    good = synthetic.make_video(width=64, height=48, seconds=1)
    assert (await load_video_async(good, spec(), LIMITS)).frames.shape[0] == 4

def _post(server: ServerProcess, parts: list[dict]) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny:qwen2_vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": parts}]}).encode()
    req = urllib.request.Request(f"{server.base}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _restarts(server: ServerProcess) -> float:
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("aphrodite_decode_worker_restarts_total"):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_served_decoder_failures_are_422_naming_the_item(hostile, isolation):
    server = ServerProcess("tiny:qwen2_vl", "--decode-isolation", isolation,
                           "--decode-workers", "1", "--mm-processor-cache-gb", "0",
                           "--media-io-kwargs",
                           json.dumps({"video": hostile_media.FOREIGN_VIDEO_IO})).wait_ready()
    try:
        good = "data:image/png;base64," + base64.b64encode(
            synthetic.make_image(32, 32, fmt="PNG")).decode()
        dds = "data:image/x-dds;base64," + base64.b64encode(hostile["image"][0]).decode()
        video = "data:video/mp4;base64," + base64.b64encode(hostile["video"][0]).decode()
        for parts, item in (
                ([{"type": "image_url", "image_url": {"url": good}},
                  {"type": "image_url", "image_url": {"url": dds}}], "media item 2 (image)"),
                ([{"type": "video_url", "video_url": {"url": video}}], "media item 1 (video)")):
            status, doc = _post(server, parts)
            assert status == 422, doc
            assert doc["error"]["code"] == "media_decode_failed"
            assert doc["error"]["message"].startswith(item), doc
        status, doc = _post(server, [{"type": "image_url", "image_url": {"url": good}}])
        assert status == 200, doc
        if isolation == "process":
            assert _restarts(server) == 0
    finally:
        assert server.stop() == 0
