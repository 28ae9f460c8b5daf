"""Start an ``aphrodite serve`` process and wait for it: the one helper the benchmarks
(``bench serve``/``sweep``/``soak`` with no ``--base-url``) and the end-to-end tests share.

The server runs on a free loopback port in a session (process group) of its own, so its
supervisor, engine, API servers and decode workers can be stopped as one, also when the
supervisor failed to stop them; it is ready when it prints its ready line. Its processes'
pids by role come from the JSON file it writes (``--process-file``), read by ``roles``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from engine.errors import ConfigError

BIN = Path(sys.executable).with_name("aphrodite")
READY_LINE = "aphrodite serving"


def roles_of(processes: dict[str, Any]) -> dict[str, int]:
    """The role names the soak samples by, from a ``--process-file`` document."""
    roles = {"supervisor": int(processes["supervisor"])}
    engines = [int(p) for p in processes["engines"]]
    for i, pid in enumerate(engines):
        roles["engine" if len(engines) == 1 else f"engine{i}"] = pid
    for i, pid in enumerate(processes["api_servers"]):
        roles[f"api{i}"] = int(pid)
    return roles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``aphrodite serve ARGS --port PORT``; its output lines are kept (``output``)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process_file = Path(tempfile.gettempdir()) / f"aphrodite-serve-{self.port}.json"
        self.proc = subprocess.Popen([str(BIN), "serve", *args, "--port", str(self.port),
                                      "--process-file", str(self.process_file)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.pgid = self.proc.pid
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if READY_LINE in line:
                self.is_ready = True
                self.ready.set()
        self.ready.set()  # it exited: wait_ready sees that

    is_ready = False

    def wait_ready(self, timeout: float = 240) -> ServerProcess:
        """Block until the ready line; a server that exits or never gets there is stopped
        and reported with its last lines, and so is one whose caller is interrupted while
        waiting (it runs in a session of its own: a terminal's Ctrl-C does not reach it)."""
        try:
            arrived = self.ready.wait(timeout)
        except BaseException:
            self.stop(timeout=10)
            raise
        if not arrived or not self.is_ready or self.proc.poll() is not None:
            self.stop(timeout=10)
            raise ConfigError(f"the server did not start within {timeout:.0f} s:\n"
                              + "".join(self.lines[-40:]))
        return self

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def processes(self) -> dict[str, Any]:
        """What the server published with ``--process-file``: ``supervisor`` (a pid),
        ``engines`` and ``api_servers`` (lists of pids)."""
        try:
            return json.loads(self.process_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"the server published no process ids ({e}): "
                              f"{self.output[-500:]}") from None

    def roles(self) -> dict[str, int]:
        """Role -> pid: ``supervisor``, ``engine`` (``engine0``, ``engine1``... with
        several data-parallel engines), ``api0``, ``api1``..."""
        return roles_of(self.processes())

    def pid_of(self, what: str) -> int:
        """The first pid of a role: ``engine``, ``API server`` or ``supervisor``."""
        found = self.processes()
        pids = {"engine": found["engines"], "API server": found["api_servers"],
                "supervisor": [found["supervisor"]]}[what]
        return int(pids[0])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the supervisor and wait for it (a drain); then kill whatever is left of its
        process group (a child it failed to stop must not outlive it). Its exit code."""
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
        self.process_file.unlink(missing_ok=True)  # a supervisor killed outright leaves it
        self._reader.join(5)  # its last lines (its stop's) are in ``output``
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
