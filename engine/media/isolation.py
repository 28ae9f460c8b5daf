"""Decode worker processes: native media decoding away from the API server process.

A crash, hang or memory blow-up of a decoder (FFmpeg through PyAV/OpenCV/torchcodec,
GStreamer, Pillow's codecs) cannot take the API server down: each decode runs in one of
``workers`` spawned processes, each with an address-space limit, under a wall-clock limit.
Frames are decoded straight into shared memory (see :mod:`engine.media.frame_memory`) and
mapped by the server without a copy. A worker that dies or runs over time is killed and
replaced; only its own request fails (a clear 422), the others keep going. At most
``max_waiting`` decodes wait for a worker; past that a decode is refused at once with a 503
(``Retry-After``) instead of queueing without bound.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import (
    MediaDecodeError,
    OverloadedError,
    ServiceUnavailableError,
)
from engine.media import frame_memory
from engine.media.decode_errors import as_decode_error

_CTX = multiprocessing.get_context("spawn")


def _run_job(kind: str, args: tuple) -> tuple[np.ndarray, Any]:
    """Decode in the worker: the array (in shared memory where possible) and its metadata."""
    if kind == "video":
        from engine.media.video.loader import load_video

        result = load_video(*args)
        return result.frames, result.metadata
    if kind == "image":
        from engine.media.image import decode_image

        image = decode_image(*args)
        out = frame_memory.empty((image.height, image.width, 3))
        out[...] = np.asarray(image)
        return out, None
    if kind == "audio":
        from engine.media.audio import decode_audio

        data, rate, max_seconds = args
        clip = decode_audio(data, sampling_rate=rate, max_seconds=max_seconds)
        return clip.samples, (clip.sampling_rate, clip.source_rate, clip.source_channels,
                              clip.codec)
    raise ValueError(f"unknown decode job {kind!r}")


def _worker_main(conn, memory_limit_bytes: int) -> None:
    """One decode worker: receives (kind, args), answers the array through shared memory."""
    import resource
    import signal

    from engine.lifetime import name_process
    from engine.memory import tune_allocator

    name_process("decode")
    # a spawned process starts with glibc's defaults: every decoded image's buffers were
    # fresh mmaps, page-faulted in and unmapped again (a 1280x720 JPEG: 17 -> 7 ms)
    tune_allocator()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    allocator = frame_memory.SharedAllocator(f"{os.getppid()}-{os.getpid()}")
    frame_memory.install(allocator)
    conn.send("ready")  # started: CPU time from here on is the requests'
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, args = message
        try:
            try:
                array, meta = _run_job(kind, args)
                segment = allocator.export(array)
                if segment is None and array.nbytes >= 1 << 20:  # decoded elsewhere: copy once
                    copy = allocator(array.shape, array.dtype)
                    copy[...] = array
                    array, segment = copy, allocator.export(copy)
            except MemoryError:
                # Native code may be left half-way after a failed allocation: answer, then
                # leave; the server replaces this worker before giving it more work.
                allocator.discard()
                conn.send(("error", MediaDecodeError(
                    "decoding the media needed more memory than a decode worker may use",
                    code="media_decode_memory",
                    hint="send smaller media or fewer frames, or raise --decode-memory-gb"),
                    None, None, "retire"))
                return
            if segment is not None:
                conn.send(("shm", segment, array.shape, array.dtype.str, meta))
            else:
                conn.send(("pipe", None, array.shape, array.dtype.str, meta))
                conn.send_bytes(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
            allocator.discard(keep=segment[0] if segment else None)
        except Exception as exc:  # any decoder failure is the item's 4xx
            allocator.discard()
            conn.send(("error", as_decode_error(kind, exc), None, None, None))
        del message, args


@dataclass
class _Worker:
    process: Any
    conn: Any
    #: the worker said it finished starting (its imports are not a request's CPU time)
    ready: bool = False


class DecodeWorkers:
    """A fixed set of decode worker processes; the ``decode_*`` methods block their thread."""

    def __init__(self, workers: int = 2, *, timeout_s: float = 60.0,
                 memory_limit_bytes: int = 8 << 30, max_waiting: int = 64,
                 cpu_budget_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        #: CPU seconds (all the worker's threads) one decode may use; 0: no budget
        self.cpu_budget_s = cpu_budget_s
        self.memory_limit_bytes = memory_limit_bytes
        self.max_waiting = max_waiting
        self.size = workers
        self.restarts = 0
        self.waiting = 0
        frame_memory.remove_orphans()
        self._idle: list[_Worker] = [self._spawn() for _ in range(workers)]
        self._cond = threading.Condition()
        self._closed = False
        #: fair sharing: workers held per client, and the clients waiting (in arrival order)
        self._held: Counter[str] = Counter()
        self._queue: list[tuple[int, str]] = []
        self._arrivals = itertools.count()
        self._last_start: dict[str, int] = {}  # while decodes wait: when each client last began

    def _spawn(self) -> _Worker:
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=_worker_main, args=(child, self.memory_limit_bytes),
                            name="aphrodite-decode-worker", daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _take(self, client: str = "") -> _Worker:
        """An idle worker. Waiting decodes are served fairly (:meth:`_next`): a freed worker
        goes to the client holding the fewest, taking turns, so one client's queue of decodes
        cannot keep another client's waiting behind it."""
        with self._cond:
            if not self._idle and self.waiting >= self.max_waiting:
                raise OverloadedError(
                    f"all {self.size} decode workers are busy and {self.waiting} decodes are "
                    "waiting", hint="retry after the Retry-After seconds, or raise "
                                    "--decode-workers / --max-decode-queue",
                    code="decode_queue_full")
            me = (next(self._arrivals), client)
            self._queue.append(me)
            self.waiting += 1
            try:
                while not self._idle or self._next() != me:
                    if self._closed:
                        raise ServiceUnavailableError("the decode workers are shut down")
                    self._cond.wait()
                self._held[client] += 1
                self._last_start[client] = next(self._arrivals)
                return self._idle.pop()
            finally:
                self.waiting -= 1
                self._queue.remove(me)
                if not self._queue:  # forget clients that neither wait nor hold a worker
                    self._last_start = {c: t for c, t in self._last_start.items()
                                        if self._held[c] > 0}
                self._cond.notify_all()

    def _next(self) -> tuple[int, str]:
        """The waiting decode to serve next: its client holds the fewest workers, then began
        a decode least recently (round robin among waiting clients), then it came first."""
        return min(self._queue, key=lambda entry: (
            self._held[entry[1]], self._last_start.get(entry[1], -1), entry[0]))

    def _give(self, worker: _Worker, client: str | None = None) -> None:
        with self._cond:
            if client is not None:
                self._held[client] -= 1
                if self._held[client] <= 0:
                    del self._held[client]
            self._idle.append(worker)
            self._cond.notify_all()

    def _replace(self, worker: _Worker, client: str | None = None) -> None:
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        frame_memory.remove_segments(f"{os.getpid()}-{worker.process.pid}-")
        self.restarts += 1
        self._give(self._spawn(), client)

    def pids(self) -> list[int]:
        with self._cond:
            return [w.process.pid for w in self._idle]

    def _call(self, kind: str, args: tuple, client: str = "") -> tuple[np.ndarray, Any]:
        worker = self._take(client)
        start = time.monotonic()
        try:
            if not worker.ready:  # a new worker's start-up is not this decode's CPU time
                self._wait_started(worker, start, client)
            cpu_start = _cpu_seconds(worker.process.pid) if self.cpu_budget_s else 0.0
            worker.conn.send((kind, args))
            while not worker.conn.poll(0.05):
                if not worker.process.is_alive():
                    raise EOFError
                if time.monotonic() - start > self.timeout_s:
                    self._replace(worker, client)
                    raise MediaDecodeError(
                        f"decoding the {kind} took longer than {self.timeout_s:g} s",
                        hint="send shorter or smaller media (the limit is --decode-timeout-s)",
                        code="media_decode_timeout")
                if self.cpu_budget_s and _cpu_seconds(worker.process.pid) - cpu_start > \
                        self.cpu_budget_s:
                    self._replace(worker, client)
                    raise MediaDecodeError(
                        f"decoding the {kind} used more than {self.cpu_budget_s:g} CPU "
                        "seconds", code="media_decode_cpu_budget",
                        hint="send shorter or smaller media (the limit is "
                             "--decode-cpu-budget-s)")
            how, where, shape, dtype, meta = worker.conn.recv()
            if how == "pipe":
                array = np.empty(shape, np.dtype(dtype))
                worker.conn.recv_bytes_into(array.reshape(-1).view(np.uint8))
        except (EOFError, OSError, BrokenPipeError):
            self._replace(worker, client)
            raise MediaDecodeError(f"the {kind} decoder crashed on this input",
                                   hint="the file is likely corrupt or hostile; re-encode it",
                                   code="media_decoder_crashed") from None
        if how == "error" and meta == "retire":
            self._replace(worker, client)
        else:
            self._give(worker, client)
        if how == "error":
            raise where
        if how == "shm":
            array = frame_memory.attach(where[0], where[1], shape, dtype, recycle=True)
        return array, meta

    def _wait_started(self, worker: _Worker, start: float, client: str) -> None:
        """Wait for a new worker's "ready". One that dies or does not start within the
        decode timeout failed before it saw this request's input: that is the server's
        trouble (503, try again), not a fault of the media."""
        try:
            while not worker.conn.poll(0.05):
                if not worker.process.is_alive() or time.monotonic() - start > self.timeout_s:
                    raise EOFError
            worker.conn.recv()
        except (EOFError, OSError):
            self._replace(worker, client)
            raise ServiceUnavailableError(
                f"a media decode worker did not start within {self.timeout_s:g} s (the server "
                "is short of memory or CPU)", hint="retry; if it persists, the server's "
                "operator may raise --decode-timeout-s or lower the load",
                code="decode_worker_unavailable") from None
        worker.ready = True

    def for_client(self, client: str) -> ClientDecoders:
        """These workers' decode calls on behalf of ``client`` (for fair sharing)."""
        return ClientDecoders(self, client)

    def decode_video(self, data: bytes, spec: Any, limits: Any, client: str = ""):
        from engine.media.video.loader import VideoFrames

        frames, metadata = self._call("video", (data, spec, limits), client)
        return VideoFrames(frames, metadata)

    def decode_image(self, data: bytes, limits: Any, client: str = ""):
        from PIL import Image

        return Image.fromarray(self.decode_image_pixels(data, limits, client))

    def decode_image_pixels(self, data: bytes, limits: Any, client: str = ""):
        """The image as an ``(H, W, 3)`` uint8 array (in the worker's shared memory)."""
        pixels, _ = self._call("image", (data, limits), client)
        return pixels

    def decode_audio(self, data: bytes, *, sampling_rate: int, max_seconds: float,
                     client: str = ""):
        from engine.media.audio import AudioClip

        samples, (rate, source_rate, channels, codec) = self._call(
            "audio", (data, sampling_rate, max_seconds), client)
        return AudioClip(samples, rate, source_rate, channels, codec)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
        frame_memory.remove_segments(f"{os.getpid()}-")


@dataclass(frozen=True)
class ClientDecoders:
    """A :class:`DecodeWorkers`' decode calls made for one client."""

    pool: DecodeWorkers
    client: str

    def decode_video(self, data: bytes, spec: Any, limits: Any):
        return self.pool.decode_video(data, spec, limits, self.client)

    def decode_image(self, data: bytes, limits: Any):
        return self.pool.decode_image(data, limits, self.client)

    def decode_image_pixels(self, data: bytes, limits: Any):
        return self.pool.decode_image_pixels(data, limits, self.client)

    def decode_audio(self, data: bytes, *, sampling_rate: int, max_seconds: float):
        return self.pool.decode_audio(data, sampling_rate=sampling_rate,
                                      max_seconds=max_seconds, client=self.client)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
