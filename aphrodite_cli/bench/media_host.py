"""The loopback media host: real HTTP over 127.0.0.1, so a server under test pays a real
download. Used by the benchmarks (``--media-delivery http``) and the end-to-end tests.

Files live in a dict (path -> bytes, MIME type[, extra headers]) that can grow while it
serves; every GET is counted per path (``hits``). A test can make a path slow to answer
(``delays``) or stall halfway through its body (``stalls``: a slow-drip host holding the
server's bytes), and ``routes`` answer paths their own way (the attacker's host in
:mod:`aphrodite_cli.bench.hostile`: redirects, drips, lying lengths). It runs in a daemon
thread of its own, so synchronous tests and the benchmarks' event loop use it alike. (The
unit tests of the HTTP fetch have their own aiohttp host, ``tests/media_server.py``, for
bytes a threaded server cannot send: a Content-Length that lies mid-stream, gzip framing.)
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
                 routes: dict[str, Route] | None = None) -> None:
        self.files: dict[str, tuple] = files if files is not None else {}
        self.hits: Counter[str] = Counter()
        self._hits_lock = threading.Lock()  # handler threads count concurrently
        self.delays = delays or {}
        self.stalls = stalls or {}
        self.routes = routes or {}
        super().__init__(("127.0.0.1", 0), _Handler)
        self.base = f"http://127.0.0.1:{self.server_address[1]}"
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

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MediaHost

    def do_GET(self) -> None:
        host = self.server
        host.count(self.path)
        time.sleep(host.delays.get(self.path, 0))  # a slow media host, on request
        url = urlsplit(self.path)
        route = host.routes.get(url.path)
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
