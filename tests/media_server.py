"""The HTTP fetch's test host: the project's loopback media host
(:class:`tests.fixtures.MediaHost`) with routes for the ways a media host can
be slow, broken, large, lying or redirecting, writing the bytes no well-behaved framework
would (a Content-Length that lies, headers and then nothing).
"""

from __future__ import annotations

import contextlib
import gzip
from http.server import BaseHTTPRequestHandler

from tests.fixtures import MediaHost, drip, synthetic

Query = dict[str, list[str]]


def _arg(query: Query, name: str, default: float) -> float:
    return float(query.get(name, [default])[0])


def _body(handler: BaseHTTPRequestHandler, status: int, data: bytes, mime: str,
          headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", mime)
    handler.send_header("Content-Length", str(len(data)))
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.end_headers()
    with contextlib.suppress(ConnectionError):
        handler.wfile.write(data)


def _redirect(handler: BaseHTTPRequestHandler, location: str) -> None:
    handler.send_response(302)
    handler.send_header("Location", location)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


class MediaServer(MediaHost):
    """Files (``files``), per-path hit counts (``hits``) and these routes:

    /redirect/N  redirects N more times, then to /img.png; /redirect-to?to=URL redirects there
    /big?size=   an honest Content-Length of ``size`` bytes (a JPEG header, then zeros)
    /chunked?size=  ``size`` bytes in chunked framing, no Content-Length
    /gzip-bomb?size=  a small gzip body that inflates to ``size`` bytes
    /slow?every=  a byte every ``every`` seconds, until the client gives up
    /flaky       503 for the first ``flaky_failures`` hits, then the PNG
    /status/CODE  that status
    /lying?claimed=N&repeat=K  claims N bytes, sends K times the PNG signature, closes
    /headers-only?claimed=N  claims N bytes, sends nothing until the client goes away
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.flaky_failures = 2
        jpeg = synthetic.make_image(320, 240, fmt="JPEG", seed=1)
        png = synthetic.make_image(64, 48, fmt="PNG", seed=2)
        files = {
            "/img.jpg": (jpeg, "image/jpeg"),
            "/img.png": (png, "image/png"),
            "/tone.wav": (synthetic.make_audio(seconds=0.5), "audio/wav"),
            "/page.html": (b"<!doctype html><html><body>not an image</body></html>",
                           "text/html"),
            "/mislabelled.png": (jpeg, "image/png"),
        }

        def redirect(handler: BaseHTTPRequestHandler, query: Query) -> None:
            if "to" in query:
                _redirect(handler, query["to"][0])
                return
            remaining = int(handler.path.split("?")[0].rsplit("/", 1)[1])
            _redirect(handler, "/img.png" if remaining <= 0 else f"/redirect/{remaining - 1}")

        def big(handler: BaseHTTPRequestHandler, query: Query) -> None:
            size = int(_arg(query, "size", 1 << 20))
            _body(handler, 200, jpeg[:16] + bytes(size - 16), "image/jpeg")

        def chunked(handler: BaseHTTPRequestHandler, query: Query) -> None:
            size = int(_arg(query, "size", 1 << 20))
            handler.protocol_version = "HTTP/1.1"  # chunked framing is HTTP/1.1's
            handler.send_response(200)
            handler.send_header("Content-Type", "image/jpeg")
            handler.send_header("Transfer-Encoding", "chunked")
            handler.send_header("Connection", "close")
            handler.end_headers()
            sent = 0
            try:
                while sent < size:
                    piece = min(65536, size - sent)
                    handler.wfile.write(b"%x\r\n" % piece + bytes(piece) + b"\r\n")
                    sent += piece
                handler.wfile.write(b"0\r\n\r\n")
            except ConnectionError:
                pass
            handler.close_connection = True

        def gzip_bomb(handler: BaseHTTPRequestHandler, query: Query) -> None:
            size = int(_arg(query, "size", 64 << 20))
            body = gzip.compress(jpeg[:16] + bytes(size - 16), compresslevel=9)
            _body(handler, 200, body, "image/jpeg", {"Content-Encoding": "gzip"})

        def slow(handler: BaseHTTPRequestHandler, query: Query) -> None:
            drip(handler, every_s=_arg(query, "every", 0.2), times=10_000)

        def flaky(handler: BaseHTTPRequestHandler, query: Query) -> None:
            if self.hits["/flaky"] <= self.flaky_failures:
                _body(handler, 503, b"try later", "text/plain")
            else:
                _body(handler, 200, png, "image/png")

        def status(handler: BaseHTTPRequestHandler, query: Query) -> None:
            _body(handler, int(handler.path.split("?")[0].rsplit("/", 1)[1]), b"nope",
                  "text/plain")

        def lying(handler: BaseHTTPRequestHandler, query: Query) -> None:
            sent = b"\x89PNG\r\n\x1a\n" * int(_arg(query, "repeat", 10))
            handler.wfile.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                + f"Content-Length: {int(_arg(query, 'claimed', 5000))}\r\n".encode()
                + b"Connection: close\r\n\r\n" + sent)
            handler.close_connection = True

        def headers_only(handler: BaseHTTPRequestHandler, query: Query) -> None:
            handler.wfile.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                + f"Content-Length: {int(_arg(query, 'claimed', 5000))}\r\n\r\n".encode())
            handler.wfile.flush()
            with contextlib.suppress(OSError):
                handler.rfile.read()  # returns once the client closes the connection
            handler.close_connection = True

        super().__init__(files, host=host, routes={
            "/redirect/": redirect, "/redirect-to": redirect, "/big": big,
            "/chunked": chunked, "/gzip-bomb": gzip_bomb, "/slow": slow, "/flaky": flaky,
            "/status/": status, "/lying": lying, "/headers-only": headers_only})

    @property
    def base_url(self) -> str:
        return self.base

    @property
    def total_hits(self) -> int:
        return self.total
