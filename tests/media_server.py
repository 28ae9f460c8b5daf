"""A loopback media server for tests: real HTTP, and a hit counter per path.

Routes cover the ways a media host can be slow, broken, large, lying or redirecting. The raw
socket server at the bottom sends bytes no well-behaved framework would (a Content-Length
that lies).
"""

from __future__ import annotations

import asyncio
import gzip
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from aphrodite_cli.bench import synthetic


@dataclass
class MediaServer:
    """State shared by the routes; ``hits`` counts requests per path."""

    hits: Counter = field(default_factory=Counter)
    flaky_failures: int = 2
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    base_url: str = ""

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())


def build_app(state: MediaServer) -> web.Application:
    jpeg = synthetic.make_image(320, 240, fmt="JPEG", seed=1)
    png = synthetic.make_image(64, 48, fmt="PNG", seed=2)
    wav = synthetic.make_audio(seconds=0.5)
    state.files.update({
        "/img.jpg": (jpeg, "image/jpeg"),
        "/img.png": (png, "image/png"),
        "/tone.wav": (wav, "audio/wav"),
        "/page.html": (b"<!doctype html><html><body>not an image</body></html>", "text/html"),
        "/mislabelled.png": (jpeg, "image/png"),
    })

    @web.middleware
    async def count(request: web.Request, handler):
        state.hits[request.path] += 1
        return await handler(request)

    async def static(request: web.Request) -> web.StreamResponse:
        entry = state.files.get(request.path)
        if entry is None:
            raise web.HTTPNotFound()
        return web.Response(body=entry[0], content_type=entry[1])

    async def redirect(request: web.Request) -> web.StreamResponse:
        """/redirect/N redirects N more times, then to /img.png; ?to= redirects there."""
        if "to" in request.query:
            raise web.HTTPFound(request.query["to"])
        remaining = int(request.match_info["n"])
        raise web.HTTPFound("/img.png" if remaining <= 0 else f"/redirect/{remaining - 1}")

    async def big(request: web.Request) -> web.StreamResponse:
        """Honest Content-Length of ?size= bytes (a JPEG header then zeros)."""
        size = int(request.query.get("size", 1 << 20))
        return web.Response(body=jpeg[:16] + bytes(size - 16), content_type="image/jpeg")

    async def chunked(request: web.Request) -> web.StreamResponse:
        """No Content-Length: streams ?size= bytes in chunks."""
        size = int(request.query.get("size", 1 << 20))
        resp = web.StreamResponse(headers={"Content-Type": "image/jpeg"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        sent = 0
        try:
            while sent < size:
                piece = min(65536, size - sent)
                await resp.write(bytes(piece))
                sent += piece
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def gzip_bomb(request: web.Request) -> web.StreamResponse:
        """A small gzip body that inflates to ?size= bytes."""
        size = int(request.query.get("size", 64 << 20))
        body = gzip.compress(jpeg[:16] + bytes(size - 16), compresslevel=9)
        return web.Response(body=body, headers={"Content-Encoding": "gzip",
                                                "Content-Type": "image/jpeg"})

    async def slow(request: web.Request) -> web.StreamResponse:
        """Drips a byte every ?every= seconds, forever (until the client gives up)."""
        every = float(request.query.get("every", 0.2))
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        try:
            for _ in range(10_000):
                await resp.write(b"\x89")
                await asyncio.sleep(every)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    async def flaky(request: web.Request) -> web.StreamResponse:
        """503 for the first ``flaky_failures`` hits, then the PNG."""
        if state.hits[request.path] <= state.flaky_failures:
            raise web.HTTPServiceUnavailable()
        return web.Response(body=png, content_type="image/png")

    async def status(request: web.Request) -> web.StreamResponse:
        return web.Response(status=int(request.match_info["code"]), text="nope")

    app = web.Application(middlewares=[count])
    app.router.add_get("/redirect/{n}", redirect)
    app.router.add_get("/redirect-to", redirect)
    app.router.add_get("/big", big)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/gzip-bomb", gzip_bomb)
    app.router.add_get("/slow", slow)
    app.router.add_get("/flaky", flaky)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/{name:.*}", static)
    return app


async def start_lying_server(claimed: int, sent: bytes) -> tuple[asyncio.Server, int, Counter]:
    """A raw HTTP server whose Content-Length claims ``claimed`` but sends ``sent`` and closes."""
    hits: Counter = Counter()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        hits["/"] += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
            + f"Content-Length: {claimed}\r\nConnection: close\r\n\r\n".encode()
            + sent
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], hits


async def start_headers_only_server(claimed: int) -> tuple[asyncio.Server, int, Counter]:
    """A raw HTTP server that sends headers with ``Content-Length: claimed`` and then no body
    at all: it waits, without sending a byte, until the client goes away."""
    hits: Counter = Counter()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            hits["/"] += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                + f"Content-Length: {claimed}\r\n\r\n".encode()
            )
            await writer.drain()
            await reader.read()  # returns b"" once the client closes the connection
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], hits
