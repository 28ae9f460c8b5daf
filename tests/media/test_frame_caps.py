"""Caps hold on every decoded frame, not on the container's claims: a stream that switches
to a bigger frame size mid-way (two MPEG-TS clips joined, the second 10x the pixels) passed
the pixel cap with its first size and then decoded at its real one."""

from __future__ import annotations

import pytest

from engine.config import MediaLimits
from engine.errors import ConfigError, MediaDecodeError
from engine.media.isolation import DecodeWorkers
from engine.media.video import load_video
from engine.media.video.options import build_spec
from engine.media.video.scan import scan_video
from tests.fixtures import hostile_media

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def growing() -> bytes:
    return hostile_media.resolution_switch_ts()


def limits() -> MediaLimits:
    return MediaLimits.from_env(max_video_frame_pixels=64 * 48 * 4)


def spec(backend: str, **kw):
    return build_spec({"backend": backend, "num_frames": 8, **kw}, backend, error=ConfigError)


def test_the_container_claims_the_first_size(growing):
    scan = scan_video(growing, limits())
    assert (scan.width, scan.height) == (64, 48)  # under the cap: the claim passes


@pytest.mark.parametrize("options", [{}, {"skip_nonref": False}])
def test_a_frame_bigger_than_the_stream_declared_is_refused(growing, options):
    with pytest.raises(MediaDecodeError) as info:
        load_video(growing, spec("pyav", **options), limits())
    assert info.value.code == "video_frame_size_changed" and info.value.status == 422
    assert "640x480" in info.value.message


def test_refused_in_a_decode_worker_too_and_the_worker_lives(growing):
    pool = DecodeWorkers(1, timeout_s=60)
    try:
        with pytest.raises(MediaDecodeError) as info:
            pool.decode_video(growing, spec("pyav"), limits())
        assert info.value.code == "video_frame_size_changed"
        assert pool.restarts == 0
    finally:
        pool.close()


def test_every_opencv_frame_has_the_declared_size(growing):
    frames = load_video(growing, spec("opencv"), limits()).frames
    assert frames.shape[1:3] == (48, 64)
