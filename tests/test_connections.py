"""Connection limits' parts: accept errors logged once (a real asyncio server out of
descriptors), the open-file limit raised to the hard limit, the total cap under it."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.server.connections import RESERVED_FDS, total_connection_cap

pytestmark = pytest.mark.timeout(120)

CHILD = r"""
import asyncio, logging, os, resource, sys
from engine.server.connections import AcceptErrorLog
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
async def main():
    log = AcceptErrorLog()
    if sys.argv[1] == "guarded":
        asyncio.get_running_loop().set_exception_handler(log)
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(float(sys.argv[2]))
    print("errors", log.count, flush=True)
    sys.stderr.flush()
    os._exit(0)
asyncio.run(main())
"""


def run_out_of_descriptors(mode: str) -> tuple[str, str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, "4"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    port = int(child.stdout.readline())
    socks = []
    for _ in range(80):
        socks.append(socket.create_connection(("127.0.0.1", port)))
    out, err = child.communicate(timeout=60)
    for sock in socks:
        sock.close()
    return out, err


def test_accept_errors_are_logged_once():
    out, err = run_out_of_descriptors("guarded")
    assert int(out.split("errors")[1]) >= 1  # it did run out
    assert err.count("accepting a connection failed") == 1
    assert "Traceback" not in err
    _, unguarded = run_out_of_descriptors("plain")
    assert unguarded.count("socket.accept() out of system resource") >= 1  # asyncio's own


def test_the_total_cap_stays_under_the_open_file_limit():
    assert total_connection_cap(4096) == 4096 - RESERVED_FDS
    assert total_connection_cap(100) == 64
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert total_connection_cap() <= max(soft - RESERVED_FDS, 64)


def test_the_served_process_runs_at_the_hard_open_file_limit():
    from tests.server_harness import ServerProcess

    server = ServerProcess().wait_ready()
    try:
        pid = server.pid_of("API server")
        limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
        line = next(x for x in limits if x.startswith("Max open files"))
        served_soft, served_hard = line.split()[3:5]
        assert served_soft == served_hard, line
    finally:
        assert server.stop() == 0
