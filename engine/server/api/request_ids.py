"""``X-Request-Id``: taken from the request when a client or gateway sends one (vLLM's
header; it then names the answer: ``chatcmpl-<id>``), made up otherwise, and returned on every
response, streamed ones included, so a client's logs and the server's name the same request."""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from engine.errors import InvalidRequestError

HEADER = "X-Request-Id"
#: the request's id, kept on the aiohttp request
KEY = "aphrodite.request_id"
_VALID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


def request_id(request: web.Request) -> str:
    """The id of ``request``: its ``X-Request-Id`` once checked, or a new one."""
    rid = request.get(KEY)
    if rid is None:
        rid = request[KEY] = uuid.uuid4().hex[:24]
    return rid


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Checks a client's ``X-Request-Id`` before anything else reads it: at most 128 of
    letters, digits and ``. _ : @ -`` (it goes into logs, headers and the answer's id)."""
    given = request.headers.get(HEADER)
    if given is not None:
        if not _VALID.fullmatch(given):
            raise InvalidRequestError(
                f"the {HEADER} header must be 1 to 128 letters, digits or . _ : @ -",
                hint=f"send a simpler {HEADER} or none (the server then makes one up)",
                param=HEADER, code="invalid_request_id")
        request[KEY] = given
    return await handler(request)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer carries its request's id."""
    response.headers[HEADER] = request_id(request)
