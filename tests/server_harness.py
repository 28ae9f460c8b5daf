"""Real `aphrodite serve` processes and a threaded loopback media server, for the end-to-end
tests (real HTTP, real clients)."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

BIN = Path(sys.executable).with_name("aphrodite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`aphrodite serve ARGS` on a free port; ``pids`` parsed from its ready line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(BIN), "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if "aphrodite serving" in line:
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float = 240) -> ServerProcess:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        return self

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def pid_of(self, what: str) -> int:
        match = re.search(rf"{what} pids? (\d+)", self.output)
        if not match:
            raise RuntimeError(f"no {what} pid in: {self.output[-500:]}")
        return int(match.group(1))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


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
