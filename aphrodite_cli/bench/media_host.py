"""The loopback media host: real HTTP over 127.0.0.1, so a server under test pays a real
download. Used by the benchmarks (``--media-delivery http``) and the end-to-end tests.

Files live in a dict (path -> bytes, MIME type) that can grow while it serves; every GET is
counted per path (``hits``). A test can make a path slow to answer (``delays``) or stall
halfway through its body (``stalls``: a slow-drip host holding the server's bytes). It runs
in a daemon thread of its own, so synchronous tests and the benchmarks' event loop use it
alike. The hostile hosts (attack catalogue, lying Content-Length) are in
:mod:`aphrodite_cli.bench.hostile`.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections import Counter


class MediaHost(http.server.ThreadingHTTPServer):
    """Serving from the moment it is made; ``stop()`` when done."""

    daemon_threads = True

    def __init__(self, files: dict[str, tuple[bytes, str]] | None = None, *,
                 delays: dict[str, float] | None = None,
                 stalls: dict[str, float] | None = None) -> None:
        self.files: dict[str, tuple[bytes, str]] = files if files is not None else {}
        self.hits: Counter[str] = Counter()
        self.delays = delays or {}
        self.stalls = stalls or {}
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
        return sum(self.hits.values())

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MediaHost

    def do_GET(self) -> None:
        host = self.server
        host.hits[self.path] += 1
        time.sleep(host.delays.get(self.path, 0))  # a slow media host, on request
        entry = host.files.get(self.path)
        if entry is None:
            self.send_error(404)
            return
        data, mime = entry
        self.send_response(200)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(data)))
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
