"""Connection limits' parts: accept errors logged once (a real asyncio server out of
descriptors), the open-file limit raised to the hard limit, the total cap under it."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.server.api.connections import RESERVED_FDS, ConnectionGuard, total_connection_cap

pytestmark = pytest.mark.timeout(120)

CHILD = r"""
import asyncio, logging, os, resource, sys
from engine.server.api.connections import AcceptErrorLog
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


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.serve()
def test_a_default_serve_decodes_in_worker_processes_at_the_hard_open_file_limit(served):
    """(The default server, shared with the other tests that ask for it: the CPU the PNG
    costs is counted from before it is sent.)"""
    import base64
    import json
    import urllib.request

    import numpy as np

    pid = served.pid_of("API server")
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    line = next(x for x in limits if x.startswith("Max open files"))
    served_soft, served_hard = line.split()[3:5]
    assert served_soft == served_hard, line
    workers = _children(pid)
    assert len(workers) == 2  # --decode-isolation process, --decode-workers 2
    before = sum(_cpu_ticks(w) for w in workers)
    noise = np.random.default_rng(0).integers(0, 256, (1500, 1500, 3), dtype=np.uint8)
    png = _png(noise)
    body = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png).decode()}}]}]})
    req = urllib.request.Request(f"{served.base}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    assert sum(_cpu_ticks(w) for w in workers) > before  # the PNG decoded there


def _png(pixels) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Handler:
    """An aiohttp RequestHandler as the guard sees it: idle or busy, closed or not."""

    def __init__(self, busy: bool = False) -> None:
        self._request_in_progress, self._messages, self.closed = busy, [], False

    def force_close(self) -> None:
        self.closed = True


class Transport:
    def __init__(self, address: str) -> None:
        self.address, self.written = address, b""

    def get_extra_info(self, name: str):
        return (self.address, 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data


class Server:
    """The hooks the guard wraps (aiohttp's web.Server has these three)."""

    def connection_made(self, handler, transport) -> None:
        pass

    def connection_lost(self, handler, exc=None) -> None:
        pass

    def request_factory(self, message, payload, protocol, *args):
        return None


def guarded(per_client: int, total: int, grace: float = 0.0) -> Server:
    server = Server()
    ConnectionGuard(per_client=per_client, total=total, header_timeout_s=0,
                    active_grace_s=grace).install(server)
    return server


def open_from(server: Server, address: str, busy: bool = False) -> tuple[Handler, Transport]:
    handler, transport = Handler(busy), Transport(address)
    server.connection_made(handler, transport)
    return handler, transport


def test_a_client_past_its_cap_replaces_its_oldest_idle_connection():
    """A gateway (one address for every user) holding idle keep-alive connections is never
    refused: its least recently active idle one is closed instead; a 503 only when every
    one it holds is busy with a request."""
    server = guarded(per_client=3, total=100)
    held = [open_from(server, "10.0.0.1")[0] for _ in range(3)]
    server.request_factory(None, None, held[0])  # the first one served a request since
    handler, transport = open_from(server, "10.0.0.1")
    assert not handler.closed and transport.written == b""
    assert [h.closed for h in held] == [False, True, False]  # the least recently active
    other, _ = open_from(server, "10.0.0.2")  # another client is not touched
    assert not other.closed
    for h in (held[0], held[2], handler):
        h._request_in_progress = True
    refused, transport = open_from(server, "10.0.0.1")
    assert refused.closed and transport.written.startswith(b"HTTP/1.1 503")
    assert b"too_many_connections" in transport.written
    assert b"--max-connections-per-client" in transport.written


def test_past_the_total_anyones_oldest_idle_connection_makes_room():
    server = guarded(per_client=0, total=3)
    first, _ = open_from(server, "10.0.0.1")
    busy, _ = open_from(server, "10.0.0.2", busy=True)
    third, _ = open_from(server, "10.0.0.3")
    newcomer, transport = open_from(server, "10.0.0.4")
    assert transport.written == b"" and first.closed and not (busy.closed or third.closed)
    server.connection_lost(first)  # (its close arrives later: counted once)
    third._request_in_progress = newcomer._request_in_progress = True
    refused, transport = open_from(server, "10.0.0.5")
    assert refused.closed and b"ulimit -n" in transport.written


def test_a_connection_active_a_moment_ago_is_not_shed():
    """aiohttp hands a request it has read to a task that marks its connection busy a moment
    later: a connection opened or sent a request within the grace is not closed in between
    (its request would be lost); past the grace it is the one to go."""
    import time

    server = guarded(per_client=1, total=100, grace=0.2)
    held, _ = open_from(server, "10.0.0.1")
    refused, transport = open_from(server, "10.0.0.1")
    assert refused.closed and not held.closed and transport.written.startswith(b"HTTP/1.1 503")
    time.sleep(0.25)
    server.request_factory(None, None, held)  # it sends a request's headers: active again
    refused, _ = open_from(server, "10.0.0.1")
    assert refused.closed and not held.closed
    time.sleep(0.25)
    newcomer, transport = open_from(server, "10.0.0.1")
    assert held.closed and not newcomer.closed and transport.written == b""
