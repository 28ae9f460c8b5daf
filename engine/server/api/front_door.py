"""The request path before any work is done for a client (CONTRIBUTING.md's map, step 1).

In this order, and nothing is held before it is earned:

1. An API key (one of ``--api-key``'s), from the headers alone (401 with
   ``WWW-Authenticate: Bearer``). A client without a key takes no pending slot, sends no
   body that is read, costs nothing else.
   Open without a key: ``/health`` and ``/ping``; ``/metrics`` only with ``--metrics-without-auth``.
2. Admission: a pending slot (``--max-pending-requests``; 503 + Retry-After when full).
   Before admission, a declared ``Content-Length`` over ``--max-request-body-mb`` is a 413.
3. The body: ``Content-Type`` must be JSON (415; a browser's cross-site form or text/plain
   cannot reach the API), its bytes are charged to the media bytes in flight as they arrive
   (``--max-inflight-media-mb``: a body is media too when it carries data URLs; chunked
   bodies count while they stream; a declared but unsent body holds nothing), it is capped
   while it streams (413), and it must arrive within ``--request-body-timeout-s`` (408): a
   client that sends headers and then drips or withholds the body loses its slot instead of
   keeping it.
4. Its counts and lengths (the route's ``check_counts``: too many messages or prompts, text
   over the byte bound), on the parsed object and before any per-item work: a 10 MB body
   of 300,000 messages is refused from ``len(messages)``, not after a walk over every one.
5. Its JSON shape, before any field is looked at: an object, nested at most
   :data:`MAX_DEPTH` deep, integers within 64 bits, finite numbers, text that is valid
   Unicode (no lone surrogates). Fields are validated after this by the protocol module.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from engine.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    RequestTimeoutError,
    RequestTooLargeError,
    UnsupportedContentTypeError,
)
from engine.media.inflight import Ticket
from engine.server.api.tenants import KEY_SALT, key_salt

MAX_DEPTH = 64
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def key_matches(header: str | None, key: str) -> bool:
    """``Authorization: Bearer KEY`` (the scheme in any case), compared in constant time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--api-key``'s value (one key, or several, as vLLM's flag takes) as a tuple of the
    non-empty keys."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    return tuple(k for k in keys if k)


def matching_key(header: str | None, keys: Sequence[str]) -> str | None:
    """Which of ``keys`` an ``Authorization`` header holds, or None; every key is compared
    (in constant time), so the time taken says nothing about which one matched."""
    found = None
    for key in keys:
        if key_matches(header, key) and found is None:
            found = key
    return found


def auth_middleware(api_key: str | Sequence[str] | None, metrics_without_auth: bool,
                    own_checks: frozenset[str] = frozenset(), salt_per_key: bool = False):
    """Refuse requests without one of the keys before any handler (and so any slot) runs.
    ``own_checks``: paths whose handlers check their own key (the admin routes);
    ``salt_per_key`` (``--cache-salt-per-api-key``): leave the matched key's salt under
    :data:`~engine.server.api.tenants.KEY_SALT` on the request."""
    open_paths = {"/health", "/ping"} | ({"/metrics"} if metrics_without_auth else set()) \
        | own_checks
    keys = api_keys(api_key)

    @web.middleware
    async def check_key(request: web.Request, handler):
        if keys and request.path not in open_paths:
            key = matching_key(request.headers.get("Authorization"), keys)
            if key is None:
                raise AuthenticationError(
                    "missing or wrong API key",
                    hint="send the header 'Authorization: Bearer <key>' with a key given to "
                         "--api-key / APHRODITE_API_KEY")
            if salt_per_key:
                request[KEY_SALT] = key_salt(key)
        return await handler(request)

    return check_key


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json"))


def check_content_type(request: web.Request) -> None:
    """A POST is JSON or says nothing (415): a browser's cross-site form or text/plain, the
    only POSTs another site's page can send without the server's consent, is refused."""
    if "Content-Type" in request.headers and not _is_json(request.content_type):
        raise UnsupportedContentTypeError(
            f"the request body has Content-Type {request.content_type!r}; the API takes JSON",
            hint="send the header 'Content-Type: application/json'")


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def check_same_origin(request: web.Request) -> None:
    """A request carrying another site's ``Origin`` (a browser sends it with every
    cross-site POST, a body-less ``fetch`` in no-cors mode included) is a 403; one without
    ``Origin`` (curl, SDKs, scripts) or from this server's own origin passes."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    scheme, _, rest = origin.strip().lower().partition("://")
    host = request.host.lower()
    if scheme in _DEFAULT_PORTS:
        default = ":" + _DEFAULT_PORTS[scheme]
        rest, host = rest.removesuffix(default), host.removesuffix(default)
    if not rest or rest != host:
        raise PermissionDeniedError(
            f"{request.path} does not take requests from another site's page (Origin "
            f"{origin[:100]!r})", code="cross_origin_request",
            hint="call it from a script or the command line (without an Origin header)")


def check_declared_length(request: web.Request, max_bytes: int) -> None:
    """A declared ``Content-Length`` over the cap is a 413 at once: before admission and
    before anything is charged, so a declaration alone holds nothing."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)


def _too_large(max_bytes: int) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"the request body is over {max_bytes / (1 << 20):g} MB",
        hint="send media by URL instead of inline, or raise --max-request-body-mb")


async def read_body(request: web.Request, timeout_s: float, ticket: Ticket,
                    max_bytes: int) -> bytes:
    """The raw body: JSON content type, at most ``max_bytes`` (413), read within
    ``timeout_s`` (408). Bytes are charged to ``ticket`` as they arrive, chunked bodies
    included: a body that is declared but not sent holds nothing, and one that streams
    counts while it streams."""
    check_content_type(request)
    check_declared_length(request, max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                ticket.charge(len(chunk))
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout_s:g} s",
            hint="send the whole body at once, or raise --request-body-timeout-s") from None
    ticket.covers_inline_media = True
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_body(body: bytes, check_counts: Callable[[dict[str, Any]], None] | None = None
               ) -> dict[str, Any]:
    """The JSON object in ``body``: ``check_counts`` first (counts and lengths, which cost
    no walk over every item), then its shape (see the module docstring)."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc.msg} at "
                                  f"position {exc.pos}", code="invalid_json") from None
    except UnicodeDecodeError:
        raise InvalidRequestError("the request body is not UTF-8 JSON",
                                  code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # an integer of thousands of digits (Python's own limit)
        raise InvalidRequestError(f"the request body holds a number out of range ({exc})",
                                  code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    if check_counts is not None:
        check_counts(data)
    check_shape(data)
    return data


def _refuse_constant(name: str) -> Any:
    raise InvalidRequestError(f"{name} is not a JSON number", code="invalid_json")


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"the request body is nested more than {MAX_DEPTH} levels deep",
                               code="invalid_json")


def check_shape(data: Any) -> None:
    """Depth, integer range, finite floats and valid Unicode, without recursion."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise InvalidRequestError("the request body holds an integer outside 64 bits",
                                          code="invalid_json")
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise InvalidRequestError("the request body holds a number out of range",
                                          code="invalid_json")
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("the request body holds text that is not valid Unicode (a "
                                  "lone surrogate escape such as \\ud800)",
                                  code="invalid_json") from None
