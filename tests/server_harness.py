"""Real `aphrodite serve` processes for the end-to-end tests: the benchmarks' helper, plus
the registry the suite uses to stop and account for every server it started."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator

from tests.fixtures import server_process

# the tests' names for them
BIN = server_process.BIN
ProcessRow = server_process.ProcessRow
describe = server_process.describe
free_port = server_process.free_port
process_table = server_process.process_table

#: Every server a test started, in start order: the conftest fixtures stop what a test left
#: running (it failed before its own ``stop``) and check at the end that no process remains.
STARTED: list[ServerProcess] = []


class ServerProcess(server_process.ServerProcess):
    """The benchmarks' server process (see tests/fixtures.py), remembered
    in :data:`STARTED` so the suite can stop and account for it."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(*args, env=env)
        STARTED.append(self)


@contextlib.contextmanager
def running(*args: str) -> Iterator[ServerProcess]:
    """A server with ``args``, ready; stopped cleanly on the way out (a module fixture's
    body: ``with running() as proc: yield proc``)."""
    proc = ServerProcess(*args).wait_ready()
    yield proc
    assert proc.stop() == 0


def openai_client(server: ServerProcess, api_key: str = "unused"):
    """The official client against ``server``, without retries (a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=api_key, max_retries=0)


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.2)
    return None


def wait_listening(port: int, timeout: float = 60) -> bool:
    """Whether something accepts connections on loopback ``port`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def situation(server: ServerProcess) -> str:
    """What a failed served test should show besides its assertion: the server's last output
    lines, its queue gauges, the machine's load and the busiest processes (a test that waits
    for the server to be in some state says why it never was)."""
    import os
    import re
    import urllib.request

    try:
        text = urllib.request.urlopen(f"{server.base}/metrics", timeout=10).read().decode()
        gauges = "\n".join(line for line in text.splitlines() if re.match(
            r"(vllm:num_requests_|aphrodite_engine_num_rows_|vllm:request_success)", line))
    except OSError as e:
        gauges = f"(no /metrics: {e})"
    top = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,rss,etimes,args", "--sort=-pcpu"],
                         capture_output=True, text=True).stdout.splitlines()[:8]
    return ("\n--- load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
            + "\n--- queue gauges:\n" + gauges + "\n--- busiest processes:\n"
            + "\n".join(line[:160] for line in top)
            + "\n--- server's last lines:\n" + "".join(server.lines[-25:]))
