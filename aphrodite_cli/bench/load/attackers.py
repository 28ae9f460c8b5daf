"""Attacks that need a client of their own, for `bench soak`: connections that send a
request's headers and then drip its body (``slow-body``), and a flood of requests whose media
host drips (``slow-drip-flood``). They run on their own event loop in a background thread,
from their own loopback address (the server tells clients apart by peer address), for as
long as the soak runs; every answer is checked against the rule it must be refused by.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from urllib.parse import urlsplit

#: kind -> the (status, code) answers each attack may get.
EXPECTED: dict[str, set[tuple[int, str]]] = {
    # the body never arrives: 408 at --request-body-timeout-s
    "slow-body": {(408, "request_body_timeout")},
    # the media host drips: the fetch deadline passes (400), or the attacker's share of the
    # fetch slots is taken and the wait for it passes the same deadline (503)
    "slow-drip-flood": {(400, "media_fetch_timeout"), (503, "fetch_slots_busy")},
}


class Attackers:
    """``slow_bodies`` connections dripping a body, and ``drip_flood`` clients sending
    requests whose image URL is ``drip_url``, back to back until :meth:`stop`."""

    #: Longest one attack may wait for its answer: the server's body deadline and fetch
    #: deadlines are far shorter, so a server that has not answered by then hangs.
    EXCHANGE_LIMIT_S = 120.0

    def __init__(self, base_url: str, model: str, *, slow_bodies: int, drip_flood: int,
                 drip_url: str, source: str | None) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.path = url.path.rstrip("/") + "/chat/completions"
        self.model = model
        self.slow_bodies, self.drip_flood, self.drip_url = slow_bodies, drip_flood, drip_url
        self.local_addr = (source, 0) if source else None
        #: (kind, status, error code, seconds): status 0 when the connection failed
        self.results: list[tuple[str, int, str | None, float]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.slow_bodies > 0 or self.drip_flood > 0

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
        tasks = [asyncio.create_task(self._forever("slow-body", self._slow_body, stopping))
                 for _ in range(self.slow_bodies)]
        tasks += [asyncio.create_task(self._forever("slow-drip-flood", self._drip, stopping))
                  for _ in range(self.drip_flood)]
        await self._stopping.wait()
        for task in tasks:  # an attack cut short by the end of the soak is not counted
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _forever(self, kind: str, attack, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.EXCHANGE_LIMIT_S):
                    status, code = await attack()
            except TimeoutError:  # the server never answered: a hang is a mismatch
                status, code = 0, "no_answer"
            except OSError:
                status, code = 0, None
            except Exception as exc:  # a broken answer is a mismatch, not a silent end
                status, code = 0, type(exc).__name__
            self.results.append((kind, status, code, time.monotonic() - start))
            if status == 0:
                await asyncio.sleep(0.5)  # the server is not there: do not spin

    async def _exchange(self, head: bytes, body: bytes, drip: bool) -> tuple[int, str | None]:
        """Send ``head`` and then ``body`` (all at once, or a byte a second while the server
        has not answered); the answer's status and error code."""
        reader, writer = await asyncio.open_connection(self.host, self.port,
                                                       local_addr=self.local_addr)
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
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            payload = await reader.readexactly(int(headers.get("content-length", "0")))
        finally:
            writer.close()
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        try:
            code = json.loads(payload)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        return status, code

    def _head(self, length: int) -> bytes:
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
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
