"""Decode worker processes: native video decoding away from the API server process.

A crash, hang or memory blow-up of a decoder cannot take the API server down: each decode runs
in one of ``workers`` processes (spawned, each with an address-space limit), with a wall-clock
limit. Frames come back through shared memory, not pickled. A worker that dies or runs over
time is killed and replaced; only its own request fails (a clear 422), the others keep
going.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from engine.errors import AphroditeError, MediaDecodeError, ServiceUnavailableError

_CTX = multiprocessing.get_context("spawn")


def _worker_main(conn, memory_limit_bytes: int) -> None:
    """One decode worker: receives (data, spec, limits), answers frames via shared memory."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    from engine.media.video.loader import load_video

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        data, spec, limits = message
        try:
            result = load_video(data, spec, limits)
            frames = result.frames
            shm = shared_memory.SharedMemory(create=True, size=max(frames.nbytes, 1))
            np.ndarray(frames.shape, frames.dtype, buffer=shm.buf)[...] = frames
            conn.send(("ok", shm.name, frames.shape, str(frames.dtype), result.metadata))
            shm.close()
        except AphroditeError as err:
            conn.send(("error", err))
        except MemoryError:
            conn.send(("error", MediaDecodeError("decoding the video needed more memory than a "
                                                 "decode worker may use",
                                                 code="video_decode_memory")))


@dataclass
class _Worker:
    process: Any
    conn: Any


class DecodeWorkers:
    """A fixed set of decode worker processes; ``decode`` blocks its calling thread."""

    def __init__(self, workers: int = 2, *, timeout_s: float = 60.0,
                 memory_limit_bytes: int = 8 << 30) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_bytes = memory_limit_bytes
        self.restarts = 0
        self._idle: list[_Worker] = [self._spawn() for _ in range(workers)]
        self._cond = threading.Condition()
        self._closed = False

    def _spawn(self) -> _Worker:
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=_worker_main, args=(child, self.memory_limit_bytes),
                            name="aphrodite-decode-worker", daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle:
                if self._closed:
                    raise ServiceUnavailableError("the decode workers are shut down")
                self._cond.wait()
            return self._idle.pop()

    def _give(self, worker: _Worker) -> None:
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        self.restarts += 1
        self._give(self._spawn())

    def pids(self) -> list[int]:
        with self._cond:
            return [w.process.pid for w in self._idle]

    def decode(self, data: bytes, spec: Any, limits: Any):
        from engine.media.video.loader import VideoFrames

        worker = self._take()
        start = time.monotonic()
        try:
            worker.conn.send((data, spec, limits))
            while not worker.conn.poll(0.05):
                if not worker.process.is_alive():
                    raise EOFError
                if time.monotonic() - start > self.timeout_s:
                    self._replace(worker)
                    raise MediaDecodeError(
                        f"decoding the video took longer than {self.timeout_s:g} s",
                        hint="send a shorter or smaller video", code="video_decode_timeout")
            reply = worker.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._replace(worker)
            raise MediaDecodeError("the video decoder crashed on this input",
                                   hint="the file is likely corrupt or hostile; re-encode it",
                                   code="video_decoder_crashed") from None
        self._give(worker)
        if reply[0] == "error":
            raise reply[1]
        _, name, shape, dtype, metadata = reply
        shm = shared_memory.SharedMemory(name=name)
        try:
            frames = np.array(np.ndarray(shape, np.dtype(dtype), buffer=shm.buf))
        finally:
            shm.close()
            shm.unlink()
        return VideoFrames(frames, metadata)

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
