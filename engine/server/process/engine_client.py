"""An API server's connection to the engine process, for asyncio handlers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from multiprocessing.connection import Client
from typing import Any

from engine.errors import EngineError, ServiceUnavailableError
from engine.server.process import shared_inputs
from engine.server.process.wire import (
    Cancel,
    Delta,
    Done,
    Events,
    FromEngine,
    ResetAnswer,
    ResetMmCache,
    ResetQuery,
    Stats,
    StatsQuery,
    Submit,
    ToEngine,
)

#: What a request's queue gets when the engine process is gone (its connection closed).
GONE = object()


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
                    loop.call_soon_threadsafe(queue.put_nowait, GONE)
                return
            self._route(message)

    def _route(self, message: FromEngine) -> None:
        if isinstance(message, ResetMmCache):  # see engine.server.api.admin_routes
            for clear in list(self.on_reset_mm_cache):
                clear()
            return
        if isinstance(message, Events):  # one engine step's token events
            self._deliver_batch(message.deltas)
            return
        target = self._queues.get(message.rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, message)

    def _deliver_batch(self, deltas: list[Delta]) -> None:
        """Hand a step's events to their requests with one wake-up of each event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        for delta in deltas:
            target = self._queues.get(delta.rid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _send(self, message: ToEngine) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _submit(self, rid: str, input_ids: list[int], mm: dict[str, Any],
                sampling: dict[str, Any],
                mm_items: tuple[list[str], list[tuple[int, int]]] = ([], []),
                prompt: str | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None, priority: int = 0,
                cache_salt: str | None = None, group: str | None = None) -> None:
        """Large inputs into shared memory, then the request to the engine: in a worker
        thread, so the megabytes of copying stay off the event loop. Segments of a message
        that was not sent are removed (no engine will map them)."""
        message, segments = shared_inputs.export(mm)
        try:
            self._send(Submit(rid, input_ids, message, sampling, *mm_items, prompt,
                              mm_processor_kwargs, priority, cache_salt, group))
        except BaseException:
            shared_inputs.discard(segments)
            raise

    async def generate(self, input_ids: list[int], mm: dict[str, Any], sampling: dict[str, Any],
                       mm_items: tuple[list[str], list[tuple[int, int]]] = ([], []),
                       prompt: str | None = None,
                       mm_processor_kwargs: dict[str, Any] | None = None, priority: int = 0,
                       cache_salt: str | None = None, group: str | None = None):
        """Yields the request's :class:`~engine.server.process.wire.Delta` s as the engine makes
        them, then its :class:`~engine.server.process.wire.Done` (a failed request raises instead).
        ``mm_items``: the prompt's items' content keys and token ranges
        (``ProcessedPrompt.mm_hashes``, ``mm_positions``), which the engine's prefix cache
        names the media by. ``prompt``, ``mm_processor_kwargs``: for an engine that runs its
        own processor (see :class:`~engine.server.process.wire.Submit`); ``priority``: vLLM's
        request
        priority; ``group``: the client request it is a prompt of (the engine shares its
        batch fairly between groups)."""
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
            await asyncio.to_thread(self._submit, rid, input_ids, plain, sampling, mm_items,
                                    prompt, mm_processor_kwargs, priority, cache_salt,
                                    group)
            while True:
                message = await queue.get()
                if isinstance(message, Delta):
                    yield message
                elif isinstance(message, Done):
                    finished = True
                    if message.error is not None:
                        raise EngineError(message.error.body["error"], message.error.status)
                    yield message
                    return
                else:
                    raise ServiceUnavailableError("the engine process stopped during the request")
        finally:
            self._queues.pop(rid, None)
            if not finished and self.alive:
                with contextlib.suppress(OSError):
                    self._send(Cancel(rid))

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
            await asyncio.to_thread(self._send, StatsQuery(rid))
            message = await asyncio.wait_for(queue.get(), timeout_s)
            return message.values if isinstance(message, Stats) else None
        except (TimeoutError, OSError):
            return None
        finally:
            self._queues.pop(rid, None)

    async def reset(self, what: str, timeout_s: float = 40.0) -> dict[str, Any] | None:
        """Ask the engine to reset a cache (``mm`` or ``prefix``, see
        :mod:`engine.server.api.admin_routes`); its answer, or None when it is gone or silent."""
        if not self.alive:
            return None
        rid = f"{self._prefix}reset-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._send, ResetQuery(rid, what))
            message = await asyncio.wait_for(queue.get(), timeout_s)
            return message.values if isinstance(message, ResetAnswer) else None
        except (TimeoutError, OSError):
            return None
        finally:
            self._queues.pop(rid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()
        shared_inputs.discard_all()


def _put_all(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
