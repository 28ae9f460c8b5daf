"""Decode worker processes: same frames as in-process, errors carried over, a killed or hung
worker fails only its own decode and is replaced."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from engine.config import MediaLimits
from engine.errors import ConfigError, MediaDecodeError, UnsupportedMediaError
from engine.media import synthetic
from engine.media.isolation import DecodeWorkers
from engine.media.video import load_video
from engine.media.video.options import build_spec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def workers():
    pool = DecodeWorkers(2, timeout_s=20)
    yield pool
    pool.close()


def spec(**kw):
    return build_spec({"backend": "pyav", "num_frames": 8, **kw}, "pyav", error=ConfigError)


def test_frames_equal_in_process_decoding(workers):
    clip = synthetic.make_video(width=160, height=120, seconds=1)
    isolated = workers.decode(clip, spec(), MediaLimits.from_env())
    local = load_video(clip, spec(), MediaLimits.from_env())
    assert (isolated.frames == local.frames).all()
    assert isolated.metadata.sampled_indices == local.metadata.sampled_indices


def test_client_errors_come_back_as_themselves(workers):
    with pytest.raises(UnsupportedMediaError):
        workers.decode(b"not a video" * 100, spec(), MediaLimits.from_env())


def test_a_killed_worker_fails_only_its_decode_and_is_replaced(workers):
    big = synthetic.make_video(width=1280, height=720, seconds=3)
    small = synthetic.make_video(width=96, height=64, seconds=1)
    outcome: dict[str, object] = {}

    def victim() -> None:
        try:
            outcome["victim"] = workers.decode(big, spec(num_frames=32, skip_nonref=False),
                                               MediaLimits.from_env())
        except MediaDecodeError as err:
            outcome["victim"] = err

    idle_before = set(workers.pids())
    thread = threading.Thread(target=victim)
    thread.start()
    deadline = time.monotonic() + 20
    busy: list[int] = []
    while not busy and time.monotonic() < deadline:
        busy = [c.pid for c in multiprocessing.active_children()
                if c.name == "aphrodite-decode-worker" and c.pid not in workers.pids()]
        time.sleep(0.02)
    assert busy
    bystander = workers.decode(small, spec(), MediaLimits.from_env())  # the other worker
    os.kill(busy[0], signal.SIGKILL)
    thread.join(60)
    assert isinstance(outcome["victim"], MediaDecodeError)
    assert outcome["victim"].code == "video_decoder_crashed"
    assert bystander.frames.shape == (8, 64, 96, 3)
    assert workers.restarts >= 1 and len(workers.pids()) == 2
    assert set(workers.pids()) != idle_before | {busy[0]}
    assert workers.decode(small, spec(), MediaLimits.from_env()).frames.shape[0] == 8


def test_a_decode_over_the_time_limit_is_killed():
    pool = DecodeWorkers(1, timeout_s=0.2)
    try:
        big = synthetic.make_video(width=1280, height=720, seconds=3)
        with pytest.raises(MediaDecodeError) as info:
            pool.decode(big, spec(num_frames=64, skip_nonref=False), MediaLimits.from_env())
        assert info.value.code == "video_decode_timeout" and pool.restarts == 1
    finally:
        pool.close()
