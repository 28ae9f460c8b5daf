"""Real `aphrodite serve` processes and a threaded loopback media server, for the end-to-end
tests (real HTTP, real clients)."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from collections import Counter

from aphrodite_cli.bench.server_process import (  # noqa: F401 (the tests' names for them)
    BIN,
    ProcessRow,
    describe,
    free_port,
    process_table,
)
from aphrodite_cli.bench.server_process import ServerProcess as _ServerProcess

#: Every server a test started, in start order: the conftest fixtures stop what a test left
#: running (it failed before its own ``stop``) and check at the end that no process remains.
STARTED: list[ServerProcess] = []


class ServerProcess(_ServerProcess):
    """The benchmarks' server process (see aphrodite_cli.bench.server_process), remembered
    in :data:`STARTED` so the suite can stop and account for it."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(*args, env=env)
        STARTED.append(self)


class MediaFiles(http.server.ThreadingHTTPServer):
    """A loopback HTTP server over an in-memory dict of files, counting hits per path."""

    def __init__(self, files: dict[str, tuple[bytes, str]],
                 delays: dict[str, float] | None = None,
                 stalls: dict[str, float] | None = None) -> None:
        """``delays``: seconds before answering; ``stalls``: seconds to pause after sending
        the first half of the body (a slow-drip host holding the server's bytes)."""
        self.files = files
        self.hits: Counter[str] = Counter()
        files_ref, hits_ref, delays_ref = self.files, self.hits, delays or {}
        stalls_ref = stalls or {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits_ref[self.path] += 1
                time.sleep(delays_ref.get(self.path, 0))  # a slow media host, on request
                entry = files_ref.get(self.path)
                if entry is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", entry[1])
                self.send_header("Content-Length", str(len(entry[0])))
                self.end_headers()
                half = len(entry[0]) // 2 if self.path in stalls_ref else len(entry[0])
                self.wfile.write(entry[0][:half])
                self.wfile.flush()
                if half < len(entry[0]):
                    time.sleep(stalls_ref[self.path])
                    self.wfile.write(entry[0][half:])

            def log_message(self, *args) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def total(self) -> int:
        return sum(self.hits.values())


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.2)
    return None
