"""Decode worker processes: same frames as in-process, errors carried over, a killed or hung
worker fails only its own decode and is replaced."""

from __future__ import annotations

import io
import mmap
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.config import MediaLimits
from engine.errors import (
    ConfigError,
    MediaDecodeError,
    OverloadedError,
    ServiceUnavailableError,
    UnsupportedMediaError,
)
from engine.media import frame_memory
from engine.media.audio import decode_audio
from engine.media.image import decode_image
from engine.media.isolation import DecodeWorkers
from engine.media.video import load_video
from engine.media.video.options import build_spec
from tests.fixtures import synthetic

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
    isolated = workers.decode_video(clip, spec(), MediaLimits.from_env())
    local = load_video(clip, spec(), MediaLimits.from_env())
    assert (isolated.frames == local.frames).all()
    assert isolated.metadata.sampled_indices == local.metadata.sampled_indices


def test_client_errors_come_back_as_themselves(workers):
    with pytest.raises(UnsupportedMediaError):
        workers.decode_video(b"not a video" * 100, spec(), MediaLimits.from_env())


def _worker_segments(worker_pid: int) -> list[Path]:
    return list(frame_memory.SHM_DIR.glob(f"{frame_memory.PREFIX}{os.getpid()}-{worker_pid}-*"))


def _stop_mid_decode(pool: DecodeWorkers, decode, attempts: int = 5) -> tuple[int, object]:
    """Run ``decode`` in a thread and SIGSTOP its worker once the worker has allocated the
    frames' shared-memory segment, i.e. in the middle of decoding: no race with the clock, on
    a fast machine or a slow one. Returns the stopped worker's pid and the thread's outcome
    holder. A decode that finished before it could be caught is run again."""
    for _ in range(attempts):
        idle = set(pool.pids())
        outcome: dict[str, object] = {}

        def run(outcome: dict[str, object] = outcome) -> None:
            try:
                outcome["result"] = decode()
            except Exception as err:
                outcome["result"] = err

        thread = threading.Thread(target=run)
        thread.start()
        busy: list[int] = []
        while thread.is_alive():
            busy = busy or sorted(idle - set(pool.pids()))
            if busy and _worker_segments(busy[0]):
                os.kill(busy[0], signal.SIGSTOP)
                outcome["thread"] = thread
                return busy[0], outcome
            time.sleep(0.001)
        thread.join()
    pytest.fail(f"the decode finished before its worker could be stopped, {attempts} times")


def test_a_killed_worker_fails_only_its_decode_and_is_replaced(workers):
    big = synthetic.make_video(width=1920, height=1080, seconds=3)
    small = synthetic.make_video(width=96, height=64, seconds=1)
    idle_before = set(workers.pids())
    victim, outcome = _stop_mid_decode(workers, lambda: workers.decode_video(
        big, spec(num_frames=90, skip_nonref=False), MediaLimits.from_env()))
    # The bystander decodes on the other worker while the victim's worker hangs, then the
    # victim's worker is killed mid-decode.
    bystander = workers.decode_video(small, spec(), MediaLimits.from_env())
    assert bystander.frames.shape == (8, 64, 96, 3)
    os.kill(victim, signal.SIGKILL)
    outcome["thread"].join(60)
    assert isinstance(outcome["result"], MediaDecodeError)
    assert outcome["result"].code == "media_decoder_crashed"
    assert workers.restarts >= 1 and len(workers.pids()) == 2
    assert victim not in workers.pids() and set(workers.pids()) != idle_before
    assert _worker_segments(victim) == []
    assert workers.decode_video(small, spec(), MediaLimits.from_env()).frames.shape[0] == 8


def test_a_decode_over_the_time_limit_is_killed_and_leaves_no_shared_memory():
    pool = DecodeWorkers(1, timeout_s=3)
    try:
        big = synthetic.make_video(width=1280, height=720, seconds=3)
        started = time.monotonic()
        hung, outcome = _stop_mid_decode(pool, lambda: pool.decode_video(
            big, spec(num_frames=64, skip_nonref=False), MediaLimits.from_env()))
        assert _worker_segments(hung)  # it hangs holding a half-filled segment
        outcome["thread"].join(60)
        error = outcome["result"]
        assert isinstance(error, MediaDecodeError) and error.code == "media_decode_timeout"
        assert "--decode-timeout-s" in error.hint
        assert time.monotonic() - started >= 3
        assert pool.restarts == 1 and hung not in pool.pids() and len(pool.pids()) == 1
        assert _worker_segments(hung) == [] and _segments() == []
        assert pool.decode_video(big, spec(), MediaLimits.from_env()).frames.shape[0] == 8
    finally:
        pool.close()


def _segments(free: bool = False) -> list[str]:
    """This process's segments held by an array (or, with ``free``, let go of and kept for
    their worker to decode into again)."""
    pattern = f"{frame_memory.PREFIX}{os.getpid()}-*"
    return sorted(p.name for p in frame_memory.SHM_DIR.glob(pattern)
                  if p.name.endswith(frame_memory.FREE) == free)


def test_frames_arrive_in_shared_memory_without_a_copy_and_the_segment_is_recycled():
    """The array is a view over the mapped segment (not a private copy). When the last array
    over it goes, the segment becomes its worker's free one, and the next decode fills that
    segment again instead of a new one (whose pages the kernel would allocate and zero);
    closing the pool removes everything."""
    pool = DecodeWorkers(1, timeout_s=20)
    try:
        clip = synthetic.make_video(width=320, height=240, seconds=1)
        isolated = pool.decode_video(clip, spec(num_frames=16), MediaLimits.from_env())
        owner = isolated.frames
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert isinstance(owner, memoryview) and isinstance(owner.obj, mmap.mmap)
        (held,) = _segments()
        local = load_video(clip, spec(num_frames=16), MediaLimits.from_env())
        assert (isolated.frames == local.frames).all()
        view = isolated.frames[3]
        del isolated, owner
        assert _segments() == [held] and _segments(free=True) == []  # a view still holds it
        del view
        assert _segments() == [] and _segments(free=True) == [held + frame_memory.FREE]
        other = synthetic.make_video(width=320, height=240, seconds=1, seed=5)
        again = pool.decode_video(other, spec(num_frames=16), MediaLimits.from_env())
        assert _segments(free=True) == [] and len(_segments()) == 1  # the free one, renamed
        assert (again.frames == load_video(other, spec(num_frames=16),
                                           MediaLimits.from_env()).frames).all()
        del again
        assert len(_segments(free=True)) == 1
    finally:
        pool.close()
    assert _segments() == [] and _segments(free=True) == []


def test_images_and_audio_decode_in_the_workers_too(workers):
    limits = MediaLimits.from_env()
    png = synthetic.make_image(640, 480, fmt="PNG")
    image = workers.decode_image(png, limits)
    assert np.array_equal(np.asarray(image), np.asarray(decode_image(png, limits)))
    wav = synthetic.make_audio(seconds=2.0, rate=22_050)
    isolated = workers.decode_audio(wav, sampling_rate=16_000, max_seconds=30)
    local = decode_audio(wav, sampling_rate=16_000, max_seconds=30)
    assert isolated.sampling_rate == 16_000 and isolated.codec == local.codec
    assert np.array_equal(isolated.samples, local.samples)  # small: came through the pipe
    with pytest.raises(UnsupportedMediaError):
        workers.decode_image(b"\x00garbage" * 50, limits)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_worker_reuses_its_memory_from_one_decode_to_the_next():
    """A decode worker tunes glibc's allocator as the server does (a spawned process starts
    with the defaults): the buffers of one decode are reused by the next instead of being
    mapped and page-faulted in again. Untuned, every decode of this 1280x720 JPEG faulted
    in about 2,260 pages (9 MB); tuned, about 43."""
    def minor_faults(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[7])

    limits = MediaLimits.from_env()
    jpeg = synthetic.make_image(1280, 720, fmt="JPEG")
    pool = DecodeWorkers(1, timeout_s=20)
    try:
        pixels = pool.decode_image_pixels(jpeg, limits)  # the worker's first: it allocates
        assert pixels.shape == (720, 1280, 3)
        del pixels
        pid = pool.pids()[0]
        faults = []
        for _ in range(3):
            before = minor_faults(pid)
            pixels = pool.decode_image_pixels(jpeg, limits)
            del pixels
            faults.append(minor_faults(pid) - before)
        assert max(faults) < 720 * 1280 * 3 // 4096 // 2, faults  # under half the image's pages
    finally:
        pool.close()


def test_an_image_item_decodes_to_pixels_without_a_pil_image_for_array_consumers(workers):
    """``--engine vllm`` packs an image item's decoded pixels: the worker's array as it came
    (mapped shared memory, no PIL image made and converted back), equal to the PIL decode, in
    a worker and in process; an EXIF rotation is applied either way."""
    from PIL import Image

    from engine.processing.media_items import item_for

    limits = MediaLimits.from_env()
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    buf = io.BytesIO()
    Image.fromarray(np.tile(np.arange(64 * 48, dtype=np.uint8).reshape(48, 64, 1), 3)).save(
        buf, format="PNG", exif=exif)
    for decoders in (workers.for_client("c"), None):
        item = item_for("image", buf.getvalue(), limits, spec(), 16_000, decoders)
        pixels = item.decode_pixels()
        assert isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8
        assert pixels.shape == (64, 48, 3)  # rotated: 64 wide stored, 64 high shown
        assert np.array_equal(pixels, np.asarray(item.decode()))
    big = synthetic.make_image(1280, 720, fmt="PNG")  # over 1 MB decoded: shared memory
    pixels = item_for("image", big, limits, spec(), 16_000, workers).decode_pixels()
    base = pixels
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(getattr(base, "obj", base), mmap.mmap)  # (a memoryview over the map)


def test_a_full_decode_queue_answers_503_at_once():
    pool = DecodeWorkers(1, timeout_s=30, max_waiting=1)
    big = synthetic.make_video(width=1280, height=720, seconds=3)
    small = synthetic.make_video(width=96, height=64, seconds=1)
    outcomes: list[object] = []

    def decode(clip) -> None:
        try:
            outcomes.append(pool.decode_video(clip, spec(num_frames=32, skip_nonref=False),
                                              MediaLimits.from_env()))
        except Exception as err:
            outcomes.append(err)

    (worker,) = pool.pids()
    os.kill(worker, signal.SIGSTOP)  # it stays busy with the first decode until resumed
    try:
        running = threading.Thread(target=decode, args=(big,))
        running.start()
        while pool.pids():
            time.sleep(0.01)
        waiting = threading.Thread(target=decode, args=(small,))
        waiting.start()
        while pool.waiting < 1:
            time.sleep(0.01)
        with pytest.raises(OverloadedError) as info:
            pool.decode_video(small, spec(), MediaLimits.from_env())
        assert info.value.status == 503 and info.value.code == "decode_queue_full"
        assert "--max-decode-queue" in info.value.hint
        os.kill(worker, signal.SIGCONT)
        running.join(60)
        waiting.join(60)
        assert all(not isinstance(o, Exception) for o in outcomes) and len(outcomes) == 2
    finally:
        pool.close()


def test_allocator_falls_back_to_ordinary_memory_without_shm(monkeypatch, tmp_path):
    monkeypatch.setattr(frame_memory, "SHM_DIR", tmp_path / "missing")
    allocator = frame_memory.SharedAllocator("test")
    array = allocator((4, 8, 3), np.dtype(np.uint8))
    assert array.shape == (4, 8, 3) and array.flags.owndata
    assert allocator.export(array) is None


def test_orphaned_segments_of_dead_servers_are_removed():
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = frame_memory.SHM_DIR / f"{frame_memory.PREFIX}{dead}-1-1"
    stale.write_bytes(b"x")
    mine = frame_memory.SHM_DIR / f"{frame_memory.PREFIX}{os.getpid()}-1-1"
    mine.write_bytes(b"x")
    try:
        frame_memory.remove_orphans()
        assert not stale.exists() and mine.exists()
    finally:
        stale.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_a_decode_over_the_memory_limit_is_a_422_and_the_worker_is_renewed():
    """The worker's address-space limit is lowered (prlimit) to what it uses after a warm-up
    plus 150 MB, and then asked for 90 frames of 720p (249 MB)."""
    import resource

    pool = DecodeWorkers(1, timeout_s=60)
    try:
        clip = synthetic.make_video(width=1280, height=720, seconds=3)
        pool.decode_video(clip, spec(), MediaLimits.from_env())
        (pid,) = pool.pids()
        status = Path(f"/proc/{pid}/status").read_text()
        size = int(next(x for x in status.splitlines() if x.startswith("VmSize")).split()[1])
        limit = size * 1024 + (150 << 20)
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
        with pytest.raises(MediaDecodeError) as info:
            pool.decode_video(clip, spec(num_frames=90), MediaLimits.from_env())
        assert info.value.status == 422 and info.value.code == "media_decode_memory"
        assert "--decode-memory-gb" in str(info.value)
        assert pool.pids() != [pid] and pool.restarts == 1  # renewed before more work
        assert pool.decode_video(clip, spec(), MediaLimits.from_env()).frames.shape[0] == 8
        assert _segments() == []
    finally:
        pool.close()


def test_a_worker_that_has_not_started_in_time_is_a_503_not_the_inputs_fault():
    """A worker that is not ready within the decode timeout (a spawned Python process takes
    far more than the millisecond allowed here) never saw the media: the answer is 503
    decode_worker_unavailable, not the 422 "the decoder crashed on this input" that a crash
    while decoding gets; the pool starts another worker."""
    pool = DecodeWorkers(1, timeout_s=0.001)
    try:
        with pytest.raises(ServiceUnavailableError) as info:
            pool.decode_image(synthetic.make_image(32, 32), MediaLimits.from_env())
        assert info.value.status == 503 and info.value.code == "decode_worker_unavailable"
        assert "did not start" in str(info.value) and "--decode-timeout-s" in str(info.value)
        assert pool.restarts == 1 and len(pool.pids()) == 1
    finally:
        pool.close()


def test_decoded_frames_passed_on_unchanged_are_handed_to_the_engine_not_copied():
    """``--engine vllm`` sends the decoded frames themselves: the worker's segment is handed
    over by name (no copy, no new segment) into the server's own inputs, the engine's mapping
    holds the same pixels and removes the name, and the segment never goes back to the worker:
    the server's array keeps its pixels after the worker decodes again. A second export of
    the same array, or of a view not at its start, copies. A handed segment no engine mapped
    goes with the server's other inputs, not with its worker."""
    import pickle
    import subprocess
    import sys

    from engine.server.process import shared_inputs

    engine = ("import sys, pickle, numpy as np; from engine.server.process import shared_inputs; "
              "mm = shared_inputs.attach(pickle.loads(sys.stdin.buffer.read())); "
              "sys.stdout.buffer.write(np.ascontiguousarray(mm['video.0']).tobytes())")
    pool = DecodeWorkers(1, timeout_s=20)
    try:
        clip = synthetic.make_video(width=320, height=240, seconds=1)
        frames = pool.decode_video(clip, spec(num_frames=16), MediaLimits.from_env()).frames
        expected = frames.copy()
        (held,) = _segments()
        sent, names = shared_inputs.export({"video.0": frames, "small": np.zeros(3)})
        shared = sent["video.0"]
        assert names == [shared.name] and f"{os.getpid()}-in-" in shared.name
        # no segment made for it: the worker's, renamed
        assert _segments() == [shared.name] and shared.name != held
        read = subprocess.run([sys.executable, "-c", engine], input=pickle.dumps(sent),
                              capture_output=True, check=True, timeout=60).stdout
        assert read == expected.tobytes()
        assert _segments() == [] and _segments(free=True) == []  # the engine removed the name
        # the worker decodes again into a new segment: the server's array keeps its pixels
        other = synthetic.make_video(width=320, height=240, seconds=1, seed=5)
        again = pool.decode_video(other, spec(num_frames=16), MediaLimits.from_env()).frames
        assert np.array_equal(frames, expected) and not np.array_equal(again, expected)
        _, names = shared_inputs.export({"a": frames, "b": again[1:]})
        assert all("-in-" in n for n in names) and len(_segments()) == 3  # two copies
        shared_inputs.discard(names)
        # handed over, never mapped (the engine died), its worker replaced: the server's
        # inputs are removed with the server's, not with the worker's segments
        _, names = shared_inputs.export({"video.0": again})
        frame_memory.remove_segments(f"{os.getpid()}-{pool._idle[0].process.pid}-")
        assert _segments() == names
        assert shared_inputs.discard_all() == 1 and _segments() == []
        del frames, again
    finally:
        pool.close()
    assert _segments() == [] and _segments(free=True) == []
