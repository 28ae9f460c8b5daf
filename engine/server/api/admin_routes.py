"""Cache resets, under vLLM's route names, for benchmarks that need a cold start without a
restart: ``POST /reset_mm_cache`` (the API servers' processor caches and media uuids, and
every engine's encoder output cache) and ``POST /reset_prefix_cache`` (the engine's prefix
cache); after both, a request is cold. Behind the same API key as every other route.

How a reset reaches every API server (``--api-server-count N``: each has its own processor
cache): the API server that took the request asks the engine process, which holds one
connection to every API server, and the engine sends
:class:`~engine.server.process.wire.ResetMmCache` down each of them before it answers. Each API
server's engine reader clears its cache when that message arrives, and the asking server's
own copy comes down its connection before the answer, so the 200 means: this server's cache
is empty, and every sibling has been told (it clears as soon as its reader reads the
message, ahead of any request the engine answers it later).

The prefix cache lives in the engine: the engine resets it when it has one with a reset
(``Engine.reset_prefix_cache()``), else the answer is a 200 that says nothing was reset and
why, so a benchmark can report it instead of assuming a cold cache.

Who may reset (every tenant's caches at once): the routes are off unless the server was
started with ``--admin-api-key`` (then they take that key alone, never a user's
``--api-key``) or ``--server-dev-mode`` (vLLM exposes them only with
``VLLM_SERVER_DEV_MODE=1``; then they take the API's key, if any); off, they answer 404
naming both flags. On, they take the API's checks too: a body that is not JSON is a 415 and
another site's ``Origin`` a 403 (a browser sends it with every cross-site POST, a body-less
one included), so a web page cannot reset them through a browser.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from engine.errors import AuthenticationError, PermissionDeniedError, RouteDisabledError
from engine.server.api.front_door import (
    api_keys,
    check_content_type,
    check_same_origin,
    matching_key,
)

#: the routes this module registers (the API's key middleware leaves them to :class:`Access`)
ADMIN_PATHS = frozenset({"/reset_mm_cache", "/reset_prefix_cache"})


@dataclass(frozen=True)
class Access:
    """Who may call the admin routes: see the module docstring."""

    admin_api_key: str | None = None
    api_key: str | tuple[str, ...] | None = None
    server_dev_mode: bool = False

    def check(self, request: web.Request) -> None:
        """Off (404), the key (401), a body's type JSON (415), no other site (403)."""
        if not self.admin_api_key and not self.server_dev_mode:
            raise RouteDisabledError(
                f"{request.path} is off on this server (it empties every client's caches)",
                hint="start the server with --admin-api-key KEY and send that key, or with "
                     "--server-dev-mode (APHRODITE_SERVER_DEV_MODE=1) for API key holders",
                code="admin_route_disabled")
        keys = api_keys(self.admin_api_key) or api_keys(self.api_key)
        if keys and matching_key(request.headers.get("Authorization"), keys) is None:
            which = "admin API key (--admin-api-key / APHRODITE_ADMIN_API_KEY)" \
                if self.admin_api_key else "API key (--api-key / APHRODITE_API_KEY)"
            raise AuthenticationError(f"missing or wrong key for {request.path}",
                                      hint=f"send 'Authorization: Bearer <key>' with the "
                                           f"{which}")
        if request.body_exists:  # (a client's empty POST says any type: the body is unused)
            check_content_type(request)
        if not keys and "Origin" in request.headers:
            # no key to hold: a page in a browser (which always says its Origin on a POST)
            # could reach this server under a name of its own (DNS rebinding), where its
            # Origin matches the Host it sends; scripts and the command line send none
            raise PermissionDeniedError(
                f"{request.path} takes no request from a web page on a server without a key",
                code="cross_origin_request",
                hint="call it from a script or the command line, or start the server with "
                     "--admin-api-key")
        check_same_origin(request)

#: where an app keeps the AppKey of its state (given by the app factory, so this module
#: needs no import of the app's)
_STATE_KEY = web.AppKey("admin_state_key", web.AppKey)
_ACCESS = web.AppKey("admin_access", Access)


def guarded(handler):
    """``handler`` behind the app's :class:`Access` checks."""
    async def checked(request: web.Request) -> web.StreamResponse:
        request.app[_ACCESS].check(request)
        return await handler(request)

    return checked


@guarded
async def reset_mm_cache(request: web.Request) -> web.Response:
    """Clear every API server's processor cache (vLLM's ``POST /reset_mm_cache``)."""
    state = request.app[request.app[_STATE_KEY]]
    answer = await state.engine.reset("mm")
    if answer is None:  # the engine is gone: at least this server starts cold
        dropped = state.pipeline.cache.clear()
        state.pipeline.uuids.clear()
        answer = {"reset": True, "api_servers": 1, "entries": dropped,
                  "note": "the engine did not answer: only this API server's cache was "
                          "cleared"}
    return web.json_response(answer)


@guarded
async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Reset the engine's prefix cache (vLLM's ``POST /reset_prefix_cache``); a 200 with
    ``"reset": false`` and a note when the engine has none."""
    answer = await request.app[request.app[_STATE_KEY]].engine.reset("prefix")
    if answer is None:
        return web.json_response({"error": {"message": "the engine did not answer the reset",
                                            "type": "service_unavailable", "param": None,
                                            "code": "engine_unavailable"}}, status=503)
    return web.json_response(answer)


def add_admin_routes(app: web.Application, state_key: web.AppKey, access: Access) -> None:
    """Register the reset routes behind ``access`` (the app's state, the engine client and
    the pipeline, is ``app[state_key]``), and at startup, once that state exists, clear this
    API server's processor cache whenever the engine passes a reset on."""
    app[_STATE_KEY] = state_key
    app[_ACCESS] = access
    app.router.add_post("/reset_mm_cache", reset_mm_cache)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)

    async def listen(app: web.Application) -> None:
        state = app[state_key]
        state.engine.on_reset_mm_cache.append(state.pipeline.cache.clear)
        state.engine.on_reset_mm_cache.append(state.pipeline.uuids.clear)
        state.engine.on_reset_mm_cache.append(state.vllm_ledger.clear)

    app.on_startup.append(listen)
