"""Attacks that need a client of their own, for `bench soak`. They run on their own event
loop in a background thread, from their own loopback address (the server tells clients apart
by peer address), for as long as the soak runs; every answer is checked against the rule it
must be refused by (:data:`EXPECTED`).

- ``slow-body``: a request's headers, then its body a byte a second (408);
- ``slow-drip-flood``: requests whose media host drips (the fetch deadline);
- ``declared-over-cap``: headers declaring a 1 GB body, no body (413 at once);
- ``declared-unsent``: headers declaring just under the body cap, nothing after (408 at the
  body deadline; together they declare more than the in-flight bound, which they must not
  hold: valid traffic is never refused for them);
- ``chunked-drip``: a chunked body streamed in 128 KB pieces past the body cap (413); the
  server's in-flight gauge is read once while it streams and must not be 0;
- ``slowloris-headers``: half a request head, a header line a second (closed, unanswered, at
  the header-read timeout);
- ``connection-hog``: from an address of its own, as many idle connections as the server
  allows one client, then more: each extra is admitted and the server closes the hog's
  oldest idle connection at once to make room (a 503 would lock out a gateway, which holds
  idle connections for every user behind one address); the rest are closed at the
  header-read timeout, then opened again.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.server.api.connections import ACTIVE_GRACE_S

#: kind -> the (status, code) answers each attack may get.
EXPECTED: dict[str, set[tuple[int, str]]] = {
    # the body never arrives: 408 at --request-body-timeout-s
    "slow-body": {(408, "request_body_timeout")},
    # the media host drips: the fetch deadline passes (400), or the attacker's share of the
    # fetch slots is taken and the wait for it passes the same deadline (503)
    "slow-drip-flood": {(400, "media_fetch_timeout"), (503, "fetch_slots_busy")},
    "declared-over-cap": {(413, "request_too_large")},
    "declared-unsent": {(408, "request_body_timeout")},
    "chunked-drip": {(413, "request_too_large")},
    # no answer, the connection closed within a few seconds of --header-read-timeout-s
    "slowloris-headers": {(0, "closed_at_header_timeout")},
    # an extra connection takes an idle one's place: the oldest, closed at once, unanswered
    "connection-hog": {(0, "oldest_idle_shed")},
}

#: How long past --header-read-timeout-s a half-sent head may stay open (a busy event loop).
HEADER_TIMEOUT_SLACK_S = 5.0
#: chunked-drip's wait between two 128 KB pieces: the 2 MB cap is passed in about 0.5 s plus
#: the gauge's read, well inside a 3 s body deadline on a loaded machine (every 0.1 s, 3 in
#: 12 streams under load met the deadline first: 408 instead of the cap's 413)
CHUNK_GAP_S = 0.03


def status_and_code(status_line: bytes | str, payload: bytes) -> tuple[int, str | None]:
    """An HTTP answer's status (0 when its first line has none) and its OpenAI error code."""
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    try:
        code = json.loads(payload)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return status, code


@dataclass(frozen=True)
class FrontDoor:
    """The front-door attacks (counts of concurrent attackers, 0: off) and the server
    settings they are judged by."""

    declared_over_cap: int = 0
    declared_unsent: int = 0
    chunked_drip: int = 0
    slowloris: int = 0
    connection_hog: int = 0
    body_cap_bytes: int = 2 << 20  # the server's --max-request-body-mb
    header_timeout_s: float = 10.0  # --header-read-timeout-s
    per_client: int = 256  # --max-connections-per-client
    hog_source: str | None = "127.0.0.3"  # the hog's own address
    hog_extras: int = 2  # connections past the cap per round

    @property
    def enabled(self) -> bool:
        return any((self.declared_over_cap, self.declared_unsent, self.chunked_drip,
                    self.slowloris, self.connection_hog))


class Attackers:
    """``slow_bodies`` connections dripping a body, ``drip_flood`` clients sending
    requests whose image URL is ``drip_url``, and the ``front_door`` attacks, back to back
    until :meth:`stop`."""

    #: Longest one attack may wait for its answer: the server's body deadline and fetch
    #: deadlines are far shorter, so a server that has not answered by then hangs.
    EXCHANGE_LIMIT_S = 120.0

    def __init__(self, base_url: str, model: str, *, slow_bodies: int, drip_flood: int,
                 drip_url: str, source: str | None,
                 front_door: FrontDoor | None = None) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.path = url.path.rstrip("/") + "/chat/completions"
        self.root = url.path.rstrip("/").removesuffix("/v1")
        self.model = model
        self.slow_bodies, self.drip_flood, self.drip_url = slow_bodies, drip_flood, drip_url
        self.local_addr = (source, 0) if source else None
        self.front_door = front_door or FrontDoor()
        #: (kind, status, error code, seconds): status 0 when the connection failed
        self.results: list[tuple[str, int, str | None, float]] = []
        #: the in-flight gauge read while each chunked body streamed
        self.inflight_seen: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.slow_bodies > 0 or self.drip_flood > 0 or self.front_door.enabled

    def counts(self) -> dict[str, object]:
        """What ran, for the result file."""
        fd = self.front_door
        return {"slow_bodies": self.slow_bodies, "drip_flood": self.drip_flood,
                "source": self.local_addr[0] if self.local_addr else None,
                "declared_over_cap": fd.declared_over_cap,
                "declared_unsent": fd.declared_unsent, "chunked_drip": fd.chunked_drip,
                "slowloris": fd.slowloris, "connection_hog": fd.connection_hog,
                "hog_source": fd.hog_source if fd.connection_hog else None,
                "inflight_seen_while_chunked_min": min(self.inflight_seen, default=None)}

    def start(self) -> Attackers:
        if self.enabled:
            self._thread = threading.Thread(target=asyncio.run, args=(self._main(),),
                                            daemon=True, name="soak-attackers")
            self._thread.start()
            self._ready.wait(30)
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(60)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = stopping = asyncio.Event()
        self._ready.set()
        fd = self.front_door
        plan = [("slow-body", self._slow_body, self.slow_bodies, 0.0),
                ("slow-drip-flood", self._drip, self.drip_flood, 0.0),
                # answered at once: paced, so it attacks the rule rather than the CPU
                ("declared-over-cap", self._over_cap, fd.declared_over_cap, 0.2),
                ("declared-unsent", self._unsent, fd.declared_unsent, 0.0),
                ("chunked-drip", self._chunked, fd.chunked_drip, 0.0),
                ("slowloris-headers", self._slowloris, fd.slowloris, 0.0),
                ("connection-hog", self._hog, fd.connection_hog, 0.2)]
        tasks = [asyncio.create_task(self._forever(kind, attack, stopping, pause))
                 for kind, attack, count, pause in plan for _ in range(count)]
        await self._stopping.wait()
        for task in tasks:  # an attack cut short by the end of the soak is not counted
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _forever(self, kind: str, attack, stopping: asyncio.Event,
                       pause: float = 0.0) -> None:
        # attackers of one kind start spread over a second, so their reconnections (each
        # counted by the server until it sees the close) do not all fall together
        await asyncio.sleep(random.random())
        while not stopping.is_set():
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.EXCHANGE_LIMIT_S):
                    answers = await attack()
            except TimeoutError:  # the server never answered: a hang is a mismatch
                answers = [(0, "no_answer")]
            except OSError:
                answers = [(0, None)]
            except Exception as exc:  # a broken answer is a mismatch, not a silent end
                answers = [(0, type(exc).__name__)]
            if isinstance(answers, tuple):
                answers = [answers]
            elapsed = time.monotonic() - start
            self.results += [(kind, status, code, elapsed) for status, code in answers]
            if any(answer == (0, None) for answer in answers):
                await asyncio.sleep(0.5)  # the server is not there: do not spin
            elif pause:
                await asyncio.sleep(pause)

    async def _exchange(self, head: bytes, body: bytes, drip: bool) -> tuple[int, str | None]:
        """Send ``head`` and then ``body`` (all at once, or a byte a second while the server
        has not answered); the answer's status and error code."""
        reader, writer = await self._connect()
        try:
            writer.write(head)
            if not drip:
                writer.write(body)
            await writer.drain()
            sent = 0
            while True:
                try:
                    status_line = await asyncio.wait_for(reader.readline(), 1.0)
                    break
                except TimeoutError:
                    if drip and sent < len(body):
                        writer.write(body[sent:sent + 1])
                        sent += 1
                        await writer.drain()
            return await self._answer(status_line, reader)
        finally:
            writer.close()

    @staticmethod
    async def _answer(status_line: bytes, reader: asyncio.StreamReader
                      ) -> tuple[int, str | None]:
        """The status and error code of the answer whose first line is ``status_line``."""
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        payload = await reader.readexactly(int(headers.get("content-length", "0")))
        return status_and_code(status_line, payload)

    def _head(self, length: int | None) -> bytes:
        size = (f"Content-Length: {length}" if length is not None
                else "Transfer-Encoding: chunked")
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\n{size}\r\n"
                "Connection: close\r\n\r\n").encode()

    async def _slow_body(self) -> tuple[int, str | None]:
        body = json.dumps({"model": self.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "x" * 4000}]}).encode()
        return await self._exchange(self._head(len(body)), body, drip=True)

    async def _drip(self) -> tuple[int, str | None]:
        body = json.dumps({"model": self.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": self.drip_url}},
                {"type": "text", "text": "What is this?"}]}]}).encode()
        return await self._exchange(self._head(len(body)), body, drip=False)

    # -- front door -----------------------------------------------------------------------
    async def _over_cap(self) -> tuple[int, str | None]:
        return await self._exchange(self._head(1 << 30), b"", drip=False)

    async def _unsent(self) -> tuple[int, str | None]:
        return await self._exchange(self._head(self.front_door.body_cap_bytes - 1024), b"",
                                    drip=False)

    async def _connect(self, local_addr: tuple[str, int] | None = None):
        return await asyncio.open_connection(self.host, self.port,
                                             local_addr=local_addr or self.local_addr)

    async def _inflight(self) -> float:
        """The server's ``aphrodite_media_bytes_in_flight`` (-1 when unreadable)."""
        reader, writer = await self._connect()
        try:
            writer.write(f"GET {self.root}/metrics HTTP/1.1\r\nHost: {self.host}\r\n"
                         "Connection: close\r\n\r\n".encode())
            text = (await reader.read()).decode("latin-1")
        finally:
            writer.close()
        for line in text.splitlines():
            if line.startswith("aphrodite_media_bytes_in_flight "):
                return float(line.split()[-1])
        return -1.0

    async def _chunked(self) -> tuple[int, str | None]:
        """128 KB pieces every :data:`CHUNK_GAP_S` (past the cap in well under the body
        deadline); the in-flight gauge read once 1 MB is out (sending waits for it, below
        the cap); sending stops when the answer comes."""
        reader, writer = await self._connect()
        piece = b"a" * (128 << 10)
        sent, gauge = 0, None
        try:
            start = b'{"messages": [{"role": "user", "content": "'
            writer.write(self._head(None) + f"{len(start):x}\r\n".encode() + start + b"\r\n")
            while True:
                await writer.drain()
                try:
                    status_line = await asyncio.wait_for(reader.readline(),
                                                         CHUNK_GAP_S)
                    break
                except TimeoutError:
                    pass
                if gauge is None and sent >= 1 << 20:
                    gauge = await self._inflight()
                    self.inflight_seen.append(gauge)
                if sent <= self.front_door.body_cap_bytes + (1 << 20):
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    sent += len(piece)
            status, code = await self._answer(status_line, reader)
        finally:
            writer.close()
        if gauge is not None and gauge <= 0:
            return status, "not_counted_while_streaming"
        return status, code

    async def _slowloris(self) -> tuple[int, str | None]:
        """Half a request head, then a header line a second until the server hangs up."""
        timeout = self.front_door.header_timeout_s
        start = time.monotonic()
        reader, writer = await self._connect()
        data = b""
        try:
            writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\n".encode())
            line = 0
            while True:
                try:
                    await writer.drain()
                    chunk = await asyncio.wait_for(reader.read(65536), 1.0)
                except TimeoutError:
                    writer.write(f"X-Slow-{line}: {line}\r\n".encode())
                    line += 1
                    continue
                except ConnectionError:
                    break
                if not chunk:
                    break
                data += chunk
        finally:
            writer.close()
        elapsed = time.monotonic() - start
        if data:  # answered instead of cut off
            return self._parse(data)
        if elapsed < timeout - 0.5:
            return 0, "closed_early"
        if elapsed > timeout + HEADER_TIMEOUT_SLACK_S:
            return 0, "closed_late"
        return 0, "closed_at_header_timeout"

    async def _hog(self) -> list[tuple[int, str | None]]:
        """One round: ``per_client`` idle connections from the hog's address, then
        ``hog_extras`` more; for each extra the oldest held one must be closed at once,
        unanswered; then the others wait for the server to close them (the header-read
        timeout), unanswered."""
        fd = self.front_door
        source = (fd.hog_source, 0) if fd.hog_source else None
        held = []
        answers: list[tuple[int, str | None]] = []
        try:
            for _ in range(fd.per_client):
                held.append(await self._connect(source))
            # idle a moment: a connection opened within the server's grace is not shed
            await asyncio.sleep(ACTIVE_GRACE_S + 0.1)
            start = time.monotonic()
            for _ in range(fd.hog_extras):
                held.append(await self._connect(source))
            for index, (reader, _) in enumerate(held):
                async with asyncio.timeout(fd.header_timeout_s + HEADER_TIMEOUT_SLACK_S):
                    try:
                        data = await reader.read()
                    except ConnectionError:
                        data = b""
                if data:
                    answers.append(self._parse(data))
                elif index < fd.hog_extras:  # the oldest: room for an extra, made at once
                    early = time.monotonic() - start < fd.header_timeout_s - 0.5
                    answers.append((0, "oldest_idle_shed" if early else "not_shed"))
        finally:
            for _, writer in held:
                writer.close()
        return answers

    @staticmethod
    def _parse(data: bytes) -> tuple[int, str | None]:
        head, _, payload = data.partition(b"\r\n\r\n")
        return status_and_code(head.split(b"\r\n", 1)[0], payload)
