"""A server started from a user's command line (``bench sweep serve --serve-cmd``): any
OpenAI-compatible server (``vllm serve M --port {port}``), in a session of its own so it is
stopped as one process group, ready when ``GET /v1/models`` answers 200, its output in a log
file. The embedded server has :mod:`aphrodite_cli.bench.harness.server_process` instead."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from aphrodite_cli.bench.harness.server_process import BIN, free_port
from engine.errors import ConfigError

#: The placeholder a --serve-cmd carries for the port the sweep picks.
PORT = "{port}"


def command_argv(template: str, port: int, extra: list[str]) -> list[str]:
    """``template`` split as a shell would, ``{port}`` replaced, ``extra`` flags after it;
    ``aphrodite`` is this install's (a virtual environment's, also when not on PATH)."""
    if PORT not in template:
        raise ConfigError(f"--serve-cmd {template!r} has no {PORT}: the sweep picks a free "
                          "port for each server", hint="e.g. --serve-cmd 'vllm serve MODEL "
                          "--port {port}'", code="invalid_flag")
    try:
        argv = shlex.split(template.replace(PORT, str(port)))
    except ValueError as exc:
        raise ConfigError(f"--serve-cmd {template!r} cannot be split into arguments ({exc})",
                          code="invalid_flag") from None
    if argv[:1] == ["aphrodite"]:
        argv[0] = str(BIN)
    return [*argv, *extra]


class CommandServer:
    """``argv`` running with its output in ``log``; ``base`` is its loopback root."""

    def __init__(self, template: str, extra: list[str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.argv = command_argv(template, self.port, extra)
        self.log = log
        with log.open("wb") as sink:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=sink, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise ConfigError(f"--serve-cmd: cannot run {self.argv[0]!r} "
                                  f"({exc.strerror or exc})", code="invalid_flag") from None

    @property
    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> CommandServer:
        """Until ``GET /v1/models`` answers 200; a server that exits first, or takes longer
        than ``timeout`` seconds, is stopped and a ConfigError carries its last lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.25)
        code = self.proc.poll()
        self.stop()
        said = f"exited with code {code}" if code is not None else (
            f"did not answer GET /v1/models within {timeout:.0f} s")
        raise ConfigError(f"the server ({' '.join(self.argv)}) {said}:\n"
                          + "\n".join(self.output.splitlines()[-40:]))

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to its process group, then SIGKILL to what is left after ``timeout``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
