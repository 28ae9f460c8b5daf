"""Real `aphrodite serve` processes for the end-to-end tests: the benchmarks' helper, plus
the registry the suite uses to stop and account for every server it started."""

from __future__ import annotations

import subprocess
import time

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


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.2)
    return None
