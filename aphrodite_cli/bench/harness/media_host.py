"""The loopback media host: real HTTP over 127.0.0.1, so a server under test pays a real
download. Used by the benchmarks (``--media-delivery http``) and the end-to-end tests.

Files live in a dict (path -> bytes, MIME type[, extra headers]) that can grow while it
serves; every GET is counted per path, query left out (``hits``). A test can make a path slow
to answer (``delays``) or stall halfway through its body (``stalls``: a slow-drip host holding
the server's bytes), and ``routes`` answer paths (or, for a key ending in "/", every path under
it) their own way, writing whatever bytes they like: the attacker's host in
:mod:`aphrodite_cli.bench.load.hostile` (redirects, drips, lying lengths) and the HTTP fetch's
unit-test host in ``tests/media_server.py`` (chunked and gzip framing, lying lengths, retries)
are routes on this host. It runs in a daemon thread of its own, so synchronous tests, async
tests and the benchmarks' event loop use it alike.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

#: a special path's answer: (the request's handler, its query) -> writes the response
Route = Callable[[http.server.BaseHTTPRequestHandler, dict[str, list[str]]], None]


class MediaHost(http.server.ThreadingHTTPServer):
    """Serving from the moment it is made; ``stop()`` when done."""

    daemon_threads = True
    # The stdlib's listen backlog is 5: a burst of fetches (the server's 16 concurrent ones)
    # overflows it and the kernel's dropped SYNs are retried a second later, which a
    # benchmark would count as fetch time.
    request_queue_size = 1024

    def __init__(self, files: dict[str, tuple] | None = None, *,
                 delays: dict[str, float] | None = None,
                 stalls: dict[str, float] | None = None,
                 routes: dict[str, Route] | None = None, host: str = "127.0.0.1") -> None:
        self.files: dict[str, tuple] = files if files is not None else {}
        self.hits: Counter[str] = Counter()
        self._hits_lock = threading.Lock()  # handler threads count concurrently
        self.delays = delays or {}
        self.stalls = stalls or {}
        self.routes = routes or {}
        super().__init__((host, 0), _Handler)
        self.base = f"http://{host}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, name="media host", daemon=True).start()

    def add(self, path: str, data: bytes, mime: str) -> str:
        """Serve ``data`` at ``path`` (``/name``); its URL."""
        self.files[path] = (data, mime)
        return self.base + path

    @property
    def total(self) -> int:
        """Requests served so far, all paths."""
        with self._hits_lock:
            return sum(self.hits.values())

    def count(self, path: str) -> None:
        with self._hits_lock:
            self.hits[path] += 1

    def route(self, path: str) -> Route | None:
        """The route answering ``path``: the one registered for it, else the longest one
        registered as a folder (a key ending in "/") that holds it."""
        found = self.routes.get(path)
        if found is None:
            folders = [k for k in self.routes if k.endswith("/") and path.startswith(k)]
            found = self.routes[max(folders, key=len)] if folders else None
        return found

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def drip(handler: http.server.BaseHTTPRequestHandler, *, every_s: float, times: int,
         claimed: int | None = None, mime: str = "image/png") -> None:
    """A route's answer that sends one byte every ``every_s`` seconds, ``times`` times (a
    host holding its client's connection), under a Content-Length of ``claimed`` bytes if
    given; stops when the client goes away."""
    handler.send_response(200)
    handler.send_header("Content-Type", mime)
    if claimed is not None:
        handler.send_header("Content-Length", str(claimed))
    handler.end_headers()
    try:
        for _ in range(times):
            handler.wfile.write(b"\x89")
            handler.wfile.flush()
            time.sleep(every_s)
    except OSError:
        return


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MediaHost

    def do_GET(self) -> None:
        host = self.server
        url = urlsplit(self.path)
        host.count(url.path)
        time.sleep(host.delays.get(self.path, 0))  # a slow media host, on request
        route = host.route(url.path)
        if route is not None:
            route(self, parse_qs(url.query))
            return
        entry = host.files.get(self.path) or host.files.get(url.path)
        if entry is None:
            self.send_error(404)
            return
        data, mime, *extra = entry
        self.send_response(200)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (extra[0] if extra else {}).items():
            self.send_header(key, value)
        self.end_headers()
        half = len(data) // 2 if self.path in host.stalls else len(data)
        try:
            self.wfile.write(data[:half])
            self.wfile.flush()
            if half < len(data):
                time.sleep(host.stalls[self.path])
                self.wfile.write(data[half:])
        except ConnectionError:
            pass  # the client gave up (a refused or cancelled download): nothing to answer

    def log_message(self, *args) -> None:
        return
