"""The engine side of the API servers' sockets, written once for both engine processes (this
project's, :mod:`engine.server.process.engine_proc`, and vLLM's bridge,
:mod:`engine.vllm_bridge.serve`): accept one connection per API server, then read each on its
own thread and route every message of :mod:`engine.server.process.wire` to the engine's
:class:`Handlers`, until the API server leaves.

Standard library and the wire only: the bridge imports it in vLLM's environment.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any, Protocol

from engine.server.process.wire import Cancel, ResetQuery, StatsQuery, Submit


class Handlers(Protocol):
    """What an engine does with one API server's messages."""

    def submit(self, message: Submit) -> None: ...

    def cancel(self, rid: str) -> None: ...

    def stats(self, message: StatsQuery) -> None: ...

    def reset(self, message: ResetQuery) -> None: ...

    def leave(self) -> None:
        """The API server disconnected: cancel its requests, stop sending to it."""


def route(handlers: Handlers, message: Any) -> None:
    """One message to its handler (an unknown one is ignored: the wire is this project's)."""
    if isinstance(message, Submit):
        handlers.submit(message)
    elif isinstance(message, Cancel):
        handlers.cancel(message.rid)
    elif isinstance(message, StatsQuery):
        handlers.stats(message)
    elif isinstance(message, ResetQuery):
        handlers.reset(message)


def read_messages(conn: Connection, handlers: Handlers,
                  call: Callable[..., Any] = lambda fn, *args: fn(*args)) -> None:
    """Read ``conn`` until the API server leaves, each message routed through ``call`` (at
    once by default; the bridge passes its loop's ``call_soon_threadsafe``), then ``leave``.
    One call per message: nothing of the last request stays bound here while it waits."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        call(route, handlers, message)
    call(handlers.leave)


def accept_api_servers(listener: Listener, count: int,
                       serve: Callable[[Connection], None]) -> list[threading.Thread]:
    """Accept one connection per API server, each served by ``serve`` on its own thread; then
    close the listener (nobody else may connect; this also removes the socket file) and its
    private folder: nothing stays on disk."""
    threads = []
    for _ in range(count):
        conn = listener.accept()
        thread = threading.Thread(target=serve, args=(conn,), daemon=True,
                                  name="api-server-connection")
        thread.start()
        threads.append(thread)
    folder = os.path.dirname(listener.address)
    listener.close()
    with contextlib.suppress(OSError):
        os.rmdir(folder)
    return threads
