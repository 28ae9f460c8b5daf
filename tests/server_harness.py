"""Real `aphrodite serve` processes and a threaded loopback media server, for the end-to-end
tests (real HTTP, real clients)."""

from __future__ import annotations

import contextlib
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
from typing import NamedTuple

BIN = Path(sys.executable).with_name("aphrodite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Every server a test started, in start order: the conftest fixtures stop what a test left
#: running (it failed before its own ``stop``) and check at the end that no process remains.
STARTED: list[ServerProcess] = []


class ServerProcess:
    """`aphrodite serve ARGS` on a free port, in a session (process group) of its own so
    the supervisor, engine, API servers and their decode workers are killed as one; ``pids``
    parsed from its ready line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(BIN), "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.pgid = self.proc.pid
        STARTED.append(self)
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
        """Signal the supervisor and wait for it; then kill whatever is left of its process
        group (a child it failed to stop must not outlive the test). Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        # What outlives the supervisor gets a moment to end on its own: a multiprocessing
        # resource tracker unlinks its processes' named semaphores once they are gone, and
        # killing it first would leave them in /dev/shm.
        self.kill_group(grace=10)
        return code

    def group_members(self) -> list[int]:
        """Live (not zombie) processes still in this server's process group."""
        return [row.pid for row in process_table() if row.pgid == self.pgid
                and row.state != "Z"]

    def kill_group(self, grace: float = 0, timeout: float = 30) -> list[str]:
        """SIGKILL every process left in the group (after ``grace`` seconds to exit on their
        own) and wait until they are gone; returns the command lines of those that were still
        there (an empty list when the supervisor cleaned up after itself)."""
        deadline = time.monotonic() + grace
        while self.group_members() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [describe(pid) for pid in self.group_members()]
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        deadline = time.monotonic() + timeout  # a killed process is gone in milliseconds
        while self.group_members() and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


def describe(pid: int) -> str:
    """``pid: command line`` of a process (for messages about processes left behind)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmd = "?"
    return f"{pid}: {cmd.strip()[:160]}"


class ProcessRow(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str


def process_table() -> list[ProcessRow]:
    """Every process on the machine, from /proc (state ``Z`` is a zombie)."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat[stat.rindex(")") + 2:].split()
        rows.append(ProcessRow(int(entry), int(fields[1]), int(fields[2]), int(fields[3]),
                               fields[0]))
    return rows


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
