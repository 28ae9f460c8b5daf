"""Decode cost is bounded per item (estimated from headers, then a CPU-time deadline) and
decode workers are shared fairly between clients. The hostile files are generated: a
progressive JPEG with thousands of repeated scans (a few hundred KB, seconds of CPU;
``hostile_media.many_scan_jpeg``, in the soak's catalogue too), a FLAC at 1 Hz whose
header has no length (each 16,384-sample frame resamples to 262 million samples), an
8-channel 384 kHz FLAC."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from engine.config import MediaLimits
from engine.errors import MediaDecodeError, MediaTooLargeError
from engine.media.audio import decode_audio
from engine.media.image import count_jpeg_scans, decode_image
from engine.media.isolation import DecodeWorkers
from tests.fixtures import hostile_media, synthetic

pytestmark = pytest.mark.timeout(300)
LIMITS = MediaLimits.from_env()


def flac(filter_graph: str, seconds: float, *extra: str) -> bytes:
    """Noise through ``filter_graph``, FLAC-encoded to a file (so its header gets the
    length)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.flac"
        subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i",
                        f"anoisesrc=r=8000:d={seconds}:a=0.5", "-filter_complex", filter_graph,
                        "-c:a", "flac", "-compression_level", "0", *extra, str(path)],
                       check=True, capture_output=True)
        return path.read_bytes()


def without_length(data: bytes) -> bytes:
    """The FLAC with its STREAMINFO's total-samples field zeroed (length unknown)."""
    assert data[:4] == b"fLaC"
    out = bytearray(data)
    out[8 + 13] &= 0xF0
    out[8 + 14:8 + 18] = bytes(4)
    return bytes(out)

many_scan_jpeg = hostile_media.many_scan_jpeg


# -- images ---------------------------------------------------------------------------------
def test_scans_are_counted_from_the_markers():
    progressive = io.BytesIO()
    Image.new("RGB", (64, 64)).save(progressive, "JPEG", progressive=True)
    assert count_jpeg_scans(progressive.getvalue(), 1000) == 10
    assert count_jpeg_scans(synthetic.make_image(64, 64), 1000) == 1
    assert count_jpeg_scans(many_scan_jpeg(64, 500), 10_000) == 510
    assert count_jpeg_scans(many_scan_jpeg(64, 500), 20) == 21  # stops past the bound


def test_a_jpeg_with_thousands_of_scans_is_refused_before_decoding():
    data = many_scan_jpeg(2000, 3000)
    assert len(data) < 100_000
    with pytest.raises(MediaTooLargeError) as info:
        decode_image(data, LIMITS)
    assert info.value.code == "image_decode_too_costly" and info.value.status == 413
    assert "APHRODITE_MAX_JPEG_SCAN_PIXELS" in str(info.value)
    normal = io.BytesIO()
    Image.new("RGB", (2000, 2000), (9, 9, 9)).save(normal, "JPEG", progressive=True)
    assert decode_image(normal.getvalue(), LIMITS).size == (2000, 2000)


def test_a_decode_over_its_cpu_budget_is_stopped():
    """With the estimate lifted, the CPU-time deadline stops it (a 422 naming the flag) and
    the replaced worker decodes the next item."""
    data = many_scan_jpeg(4000, 4000)  # several CPU seconds
    lifted = MediaLimits.from_env(max_jpeg_scan_pixels=1 << 62)
    pool = DecodeWorkers(1, timeout_s=120, cpu_budget_s=0.2)
    try:
        with pytest.raises(MediaDecodeError) as info:
            pool.decode_image(data, lifted)
        assert info.value.code == "media_decode_cpu_budget"
        assert "--decode-cpu-budget-s" in str(info.value)
        assert pool.decode_image(synthetic.make_image(32, 32), LIMITS).size == (32, 32)
    finally:
        pool.close()



@pytest.mark.parametrize("modality", ["video", "audio"])
def test_in_the_api_servers_threads_the_budget_is_checked_between_frames(modality):
    """``--decode-isolation thread``: no process to stop, so the video and audio loops check
    the decode's budget between frames: a budget shorter than one decode is the item's 422
    naming the flag, a budget of 0 is none, and the budget ends with the decode (the next one
    on the same thread has its own)."""
    from engine.media.video.options import build_spec
    from engine.processing.media_items import InProcessDecoders

    limits = MediaLimits.from_env()
    if modality == "video":
        data = synthetic.make_video(width=320, height=240, seconds=2)
        spec = build_spec({"backend": "pyav", "num_frames": 32, "skip_nonref": False}, "pyav",
                          error=ValueError)

        def decode(decoders):
            return decoders.decode_video(data, spec, limits).frames.shape[0]
    else:
        data = synthetic.make_audio(seconds=20, rate=48_000, fmt="flac")

        def decode(decoders):
            return decoders.decode_audio(data, sampling_rate=16_000, max_seconds=60).samples.size

    done = decode(InProcessDecoders(0.0))
    assert done > 0
    with pytest.raises(MediaDecodeError) as info:
        decode(InProcessDecoders(1e-6))
    assert info.value.status == 422 and info.value.code == "media_decode_cpu_budget"
    assert "--decode-cpu-budget-s" in str(info.value)
    assert decode(InProcessDecoders(600.0)) == done

# -- audio ----------------------------------------------------------------------------------
def test_a_1_hz_clip_without_a_length_is_refused_before_resampling():
    """One frame of it resamples to 262 million samples (1 GB): the old code ran out of the
    worker's memory; now its source duration is checked on the frame, before resampling."""
    data = without_length(flac("[0]aformat=channel_layouts=7.1,asetrate=1", 10,
                               "-frame_size", "16384"))
    pool = DecodeWorkers(1, timeout_s=120, memory_limit_bytes=1 << 30)
    try:
        with pytest.raises(MediaTooLargeError) as info:
            pool.decode_audio(data, sampling_rate=16_000, max_seconds=600)
        assert info.value.code == "audio_too_long"
        assert pool.restarts == 0
    finally:
        pool.close()


def test_channels_times_rate_times_duration_is_budgeted():
    data = flac("[0]aformat=channel_layouts=7.1,aresample=384000", 1)
    with pytest.raises(MediaTooLargeError) as info:  # from the header
        decode_audio(data, max_seconds=600, max_decode_samples=1_000_000)
    assert info.value.code == "audio_decode_too_costly" and "header" in info.value.message
    with pytest.raises(MediaTooLargeError) as info:  # no length in the header: counted
        decode_audio(without_length(data), max_seconds=600, max_decode_samples=1_000_000)
    assert info.value.code == "audio_decode_too_costly"
    assert decode_audio(data, max_seconds=600).duration_s == pytest.approx(1.0, abs=0.05)


# -- fair sharing ---------------------------------------------------------------------------
def test_a_freed_worker_goes_to_the_client_that_waited_without_one():
    """One worker, held (stopped) by client A; A queues two more decodes, then B one: B is
    served before A's queued ones (the old pool served waiters in no fixed order). The order
    is the one the worker was handed out in: the order the threads return in is the
    scheduler's (on a loaded machine B1's thread can return after A2's)."""
    order: list[str] = []

    class Recording(DecodeWorkers):
        def _take(self, client: str = ""):
            worker = super()._take(client)
            order.append(threading.current_thread().name)  # under no lock: one worker
            return worker

    pool = Recording(1, timeout_s=120)
    image = synthetic.make_image(32, 32)
    worker = pool.pids()[0]
    os.kill(worker, signal.SIGSTOP)
    try:
        def decode(client: str) -> None:
            pool.for_client(client).decode_image(image, LIMITS)

        threads = []
        for name, client, waiting in (("A1", "a", 0), ("A2", "a", 1), ("A3", "a", 2),
                                      ("B1", "b", 3)):
            thread = threading.Thread(target=decode, args=(client,), name=name)
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 60
            while pool.waiting < waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.waiting >= waiting
            if name == "A1":  # A1 holds the worker (and no longer waits) before others queue
                while (not pool._held["a"] or pool.waiting) and time.monotonic() < deadline:
                    time.sleep(0.01)
        os.kill(worker, signal.SIGCONT)
        for thread in threads:
            thread.join(60)
        assert order == ["A1", "B1", "A2", "A3"]
    finally:
        os.kill(worker, signal.SIGCONT)
        pool.close()


def test_served_a_costly_decode_is_stopped_while_another_client_is_served():
    """End to end, one decode worker: two attackers (127.0.0.2) send the many-scan JPEG with
    the estimate lifted, so each decode runs into the CPU budget (422 naming the flag); a
    client on 127.0.0.1 is served meanwhile."""
    import base64
    import http.client
    import json

    from tests.server_harness import ServerProcess

    server = ServerProcess("--decode-workers", "1", "--decode-cpu-budget-s", "0.3",
                           "--mm-processor-cache-gb", "0",
                           env={"APHRODITE_MAX_JPEG_SCAN_PIXELS": str(1 << 60)}).wait_ready()

    class FromAddress(http.client.HTTPConnection):
        def __init__(self, source: str) -> None:
            super().__init__("127.0.0.1", server.port, timeout=120,
                             source_address=(source, 0))

    def ask(image: bytes, source: str) -> tuple[int, dict]:
        body = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {
                "url": "data:image/jpeg;base64," + base64.b64encode(image).decode()}}]}]})
        conn = FromAddress(source)
        try:
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    costly = many_scan_jpeg(4000, 4000)
    stop = threading.Event()
    attacks: list[tuple[int, str]] = []

    def attacker() -> None:
        while not stop.is_set():
            status, doc = ask(costly, "127.0.0.2")
            attacks.append((status, doc["error"]["code"] if status != 200 else ""))

    threads = [threading.Thread(target=attacker) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        while not attacks:  # the attack is under way
            time.sleep(0.05)
        served = [ask(synthetic.make_image(64, 48), "127.0.0.1") for _ in range(3)]
        assert [status for status, _ in served] == [200, 200, 200], served
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        assert server.stop() == 0
    assert attacks and all(a == (422, "media_decode_cpu_budget") for a in attacks), attacks
