"""The engine process's side of a cache reset (``POST /reset_mm_cache``,
``POST /reset_prefix_cache``; the routes are in :mod:`engine.server.api.admin_routes`): carried
out on the engine's connection thread. Apart from the routes, so the engine process never
imports the web framework (an import of aiohttp there took half a second of the engine's
GIL at the first reset)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def engine_answer(engine: Any, what: str, senders: list[Callable[[Any], None]]
                  ) -> dict[str, Any]:
    """In the engine process: carry out ``what`` (``mm``: empty the engine's encoder output
    cache and tell every API server to clear its processor cache; ``prefix``: reset the
    prefix cache) and say what was done."""
    if what == "mm":
        from engine.server.process.wire import ResetMmCache

        reset_encoder = getattr(engine, "reset_encoder_cache", None)
        encoder = reset_encoder() if reset_encoder is not None else {}
        for send in list(senders):
            send(ResetMmCache())
        answer = {"reset": encoder.get("reset", True), "api_servers": len(senders)}
        return {**answer, **{k: v for k, v in encoder.items() if k != "reset"}}
    if what == "prefix":
        reset = getattr(engine, "reset_prefix_cache", None)
        if reset is None:
            return {"reset": False, "has_cache": False,
                    "note": "this engine has no prefix cache: nothing to reset"}
        answer = reset()
        if isinstance(answer, dict):
            return {"reset": True, **answer}
        return {"reset": answer is not False,
                **({} if answer is not False else
                   {"note": "the engine's prefix cache is disabled or could not be reset"})}
    return {"reset": False, "note": f"unknown cache {what!r}"}
