"""An API server's connection to the engine process, for asyncio handlers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from typing import Any

from engine.errors import AphroditeError, ServiceUnavailableError
from engine.server import shared_inputs


@dataclass
class Completion:
    outputs: list[tuple[int, str, list[int], str | None]] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)


class EngineError(AphroditeError):
    """An error the engine process reported, re-raised here with its status and shape."""

    def __init__(self, body: dict[str, Any], status: int) -> None:
        super().__init__(body.get("message", "engine error"), code=body.get("code"),
                         param=body.get("param"))
        self.status = status  # type: ignore[misc]
        self.type = body.get("type", "internal_error")  # type: ignore[misc]


class EngineClient:
    """Sends requests to the engine process; routes its events to per-request queues."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self._conn = Client(address, authkey=authkey)
        self._send_lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-"
        self.alive = True
        #: called (in the reader thread) when the engine passes a processor cache reset on
        self.on_reset_mm_cache: list = []
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.alive = False
                shared_inputs.discard_all()  # inputs the engine did not map: nobody will
                for loop, queue in list(self._queues.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, ("gone",))
                return
            if message[0] == "reset_mm_cache":  # see engine.server.admin_routes
                for clear in list(self.on_reset_mm_cache):
                    clear()
                continue
            if message[0] == "events":  # one engine step's token events
                self._deliver_batch(message[1])
                continue
            target = self._queues.get(message[1])
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, message)

    def _deliver_batch(self, events: list[tuple]) -> None:
        """Hand a step's events to their requests with one wake-up of each event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        for event in events:
            target = self._queues.get(event[1])
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _submit(self, rid: str, input_ids: list[int], mm: dict[str, Any],
                sampling: dict[str, Any]) -> None:
        """Large inputs into shared memory, then the request to the engine: in a worker
        thread, so the megabytes of copying stay off the event loop. Segments of a message
        that was not sent are removed (no engine will map them)."""
        message, segments = shared_inputs.export(mm)
        try:
            self._send(("submit", rid, input_ids, message, sampling))
        except BaseException:
            shared_inputs.discard(segments)
            raise

    async def generate(self, input_ids: list[int], mm: dict[str, Any], sampling: dict[str, Any]):
        """Yields ("event", rid, index, token, delta, reason, logprobs) tuples (logprobs:
        None or (logprob, rank, top_ids, top_logprobs)), then a Completion."""
        if not self.alive:
            raise ServiceUnavailableError("the engine process is not running",
                                    hint="check the server log; restart the server")
        rid = f"{self._prefix}{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            # numpy, not torch: torch's pickler would move every tensor into shared memory and
            # pass a file descriptor per storage, which the processor cache then keeps open.
            plain = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in mm.items()}
            await asyncio.to_thread(self._submit, rid, input_ids, plain, sampling)
            while True:
                message = await queue.get()
                if message[0] == "event":
                    yield message
                elif message[0] == "done":
                    finished = True
                    _, _, outputs, timings, error = message
                    if error is not None:
                        body, status = error
                        raise EngineError(body["error"], status)
                    yield Completion(outputs, timings)
                    return
                else:
                    raise ServiceUnavailableError("the engine process stopped during the request")
        finally:
            self._queues.pop(rid, None)
            if not finished and self.alive:
                with contextlib.suppress(OSError):
                    self._send(("cancel", rid))

    async def stats(self, timeout_s: float = 2.0) -> dict[str, float] | None:
        """The engine process's memory numbers (see ``engine_proc.process_stats``); None when
        it is gone or does not answer in time (it answers between two messages, not between
        two forward passes, so a busy engine still answers at once)."""
        if not self.alive:
            return None
        rid = f"{self._prefix}stats-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._send, ("stats", rid))
            message = await asyncio.wait_for(queue.get(), timeout_s)
            return message[2] if message[0] == "stats" else None
        except (TimeoutError, OSError):
            return None
        finally:
            self._queues.pop(rid, None)

    async def reset(self, what: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Ask the engine to reset a cache (``mm`` or ``prefix``, see
        :mod:`engine.server.admin_routes`); its answer, or None when it is gone or silent."""
        if not self.alive:
            return None
        rid = f"{self._prefix}reset-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._send, ("reset", rid, what))
            message = await asyncio.wait_for(queue.get(), timeout_s)
            return message[2] if message[0] == "reset" else None
        except (TimeoutError, OSError):
            return None
        finally:
            self._queues.pop(rid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()
        shared_inputs.discard_all()


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
