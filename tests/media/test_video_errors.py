"""Bad video fails with a clear client error, in bounded time and memory, on every backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import MediaLimits
from engine.errors import ClientError, ConfigError, MediaTooLargeError
from engine.media.video import load_video
from engine.media.video.options import build_spec
from tests.fixtures import synthetic

BACKENDS = ["pyav", "opencv", "torchcodec", "deepstream"]


def mkv_without_frames() -> bytes:
    """A Matroska file with a video track and no frames: the header, cut before the first
    Cluster."""
    data = synthetic.make_video(width=64, height=48, seconds=0.2, container="matroska")
    return data[: data.index(b"\x1f\x43\xb6\x75")]


def moov_zeroed() -> bytes:
    data = bytearray(synthetic.make_video(width=64, height=48, seconds=0.3))
    at = data.index(b"moov")
    data[at + 8: at + 200] = bytes(192)
    return bytes(data)


def faststart_clip(folder):
    """A 60-frame MP4 with its index first (moov before mdat), written to ``folder``."""
    import av

    path = folder / "fast.mp4"
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        for i in range(60):
            frame = av.VideoFrame.from_ndarray(synthetic.video_frame(i, 160, 120),
                                               format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


BAD = {
    "garbage": (lambda: bytes(range(256)) * 40, 400),
    "truncated-index-at-end": (lambda: synthetic.make_video(width=64, height=48,
                                                            seconds=1)[:4000], 400),
    "corrupt-header": (moov_zeroed, 422),
    "audio-only": (lambda: synthetic.make_audio(seconds=0.3), 422),
    "zero-frames": (mkv_without_frames, (400, 422)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_video_is_a_client_error(kind, backend):
    make, status = BAD[kind]
    spec = build_spec({"backend": backend, "num_frames": 8}, backend, error=ConfigError)
    with pytest.raises(ClientError) as info:
        load_video(make(), spec, MediaLimits.from_env())
    assert info.value.status in (status if isinstance(status, tuple) else (status,)), info.value
    text = str(info.value)
    assert "Errno" not in text and "0x" not in text and "/" not in text.split("(")[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["pyav", "opencv", "torchcodec", "deepstream"])
def test_frames_missing_at_the_end_is_422(tmp_path, backend):
    """An index-first MP4 cut in half: the header promises frames that are not there."""
    path = faststart_clip(tmp_path)
    data = path.read_bytes()
    spec = build_spec({"backend": backend, "num_frames": 8}, backend, error=ConfigError)
    with pytest.raises(ClientError) as info:
        load_video(data[: len(data) // 2], spec, MediaLimits.from_env())
    assert info.value.status == 422 and "truncated" in info.value.message


@pytest.mark.timeout(60)
def test_enormous_resolution_refused_before_decoding():
    big = synthetic.make_video(width=7680, height=4320, seconds=1 / 30, fps=30, crf=51)
    spec = build_spec({"backend": "pyav"}, "pyav", error=ConfigError)
    with pytest.raises(MediaTooLargeError) as info:
        load_video(big, spec, MediaLimits.from_env())
    assert info.value.code == "video_too_many_pixels"
    assert "APHRODITE_MAX_VIDEO_FRAME_PIXELS" in info.value.hint


@pytest.mark.timeout(60)
def test_enormous_frame_count_refused_while_counting():
    many = synthetic.make_video(width=16, height=16, fps=1000, seconds=1.5, gop=250)
    limits = replace(MediaLimits.from_env(), max_video_frames=1000)
    spec = build_spec({"backend": "opencv"}, "opencv", error=ConfigError)
    with pytest.raises(MediaTooLargeError) as info:
        load_video(many, spec, limits)
    assert info.value.code == "video_too_many_frames"
    assert "APHRODITE_MAX_VIDEO_FRAMES" in info.value.hint


def test_decoded_size_cap():
    data = synthetic.make_video(width=320, height=240, seconds=1)
    limits = replace(MediaLimits.from_env(), max_video_decoded_bytes=320 * 240 * 3 * 4)
    spec = build_spec({"backend": "pyav", "num_frames": 5}, "pyav", error=ConfigError)
    with pytest.raises(MediaTooLargeError) as info:
        load_video(data, spec, limits)
    assert "num_frames" in info.value.hint
    ok = build_spec({"backend": "pyav", "num_frames": 4}, "pyav", error=ConfigError)
    assert load_video(data, ok, limits).frames.shape == (4, 240, 320, 3)


def test_gstreamer_loaded_does_not_turn_decoder_exceptions_into_aborts(tmp_path):
    """GStreamer's core links libunwind; loaded carelessly it hijacks C++ exception unwinding
    and torchcodec's error on a truncated file aborts the process. Run in a subprocess."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        from engine.config import MediaLimits
        from engine.errors import ClientError, ConfigError
        from tests.fixtures import synthetic
        from engine.media.video import load_video
        from engine.media.video.options import build_spec
        limits = MediaLimits.from_env()
        clip = synthetic.make_video(width=64, height=48, seconds=0.5)
        load_video(clip, build_spec({"backend": "deepstream"}, "x", error=ConfigError), limits)
        data = open(%r, "rb").read()
        try:
            load_video(data[: len(data) // 2],
                       build_spec({"backend": "torchcodec"}, "x", error=ConfigError), limits)
        except ClientError as err:
            print("CLIENT", err.status)
    """)
    path = faststart_clip(tmp_path)
    done = subprocess.run([sys.executable, "-c", code % str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert "CLIENT 422" in done.stdout
