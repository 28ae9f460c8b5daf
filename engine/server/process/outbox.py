"""Messages to one API server, pickled and written by a thread of their own.

Used by both engine processes (this project's engine, :mod:`engine.server.process.engine_proc`, and
vLLM's behind ``--engine vllm``, :mod:`engine.vllm_bridge.serve`): the thread that produces
the messages hands them over and goes on. Standard library only (the vLLM bridge imports it
in vLLM's environment).
"""

from __future__ import annotations

import logging
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("aphrodite.engine")


class Outbox:
    """The messages to one API server, pickled and written by a thread of their own, in the
    order they were put: the engine thread hands a step's events over and goes on to the next
    step (the socket write wakes the API server, which may take the core; here that happens
    beside the engine's computation, which runs without the GIL). At most ``limit`` messages
    wait: past it ``put`` waits for the writer, as a write to a full socket would (an API
    server that stops reading holds the engine back, not its memory). Once the connection is
    closed or found broken, messages are dropped at once (``put`` never waits on a queue that
    nobody writes out): the API server that would read them is gone."""

    def __init__(self, conn: Connection, limit: int = 4096) -> None:
        self._conn = conn
        self._queue: queue.Queue = queue.Queue(limit)
        self._closed = False  # close() was called: what was put before is still written
        self._broken = False  # a write failed: nothing more is written
        self._thread = threading.Thread(target=self._write, name="engine outbox", daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        if not (self._closed or self._broken):
            self._queue.put(message)

    def close(self, timeout: float = 5.0) -> None:
        """Write what was put so far, then stop the thread; later messages are dropped."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _write(self) -> None:
        while (message := self._queue.get()) is not None:
            if self._broken:
                continue  # drain what waits (a put may be blocked on it), write nothing
            try:
                self._conn.send(message)
            except (OSError, EOFError):
                self._broken = True
            except Exception:  # a message that cannot be pickled: a bug, not the peer's end
                logger.exception("engine: a message to an API server could not be sent")
