"""Before a cold phase: ask the target to empty its caches, by vLLM's route names.

``POST /reset_mm_cache`` (the processor / multimodal cache) and ``POST /reset_prefix_cache``
(the prefix cache). This project's server has both; vLLM has them (``/reset_mm_cache`` only
with ``VLLM_SERVER_DEV_MODE=1``); a target without one answers 404 (or 405), which is said in
the output and the result, never taken for a reset. A cold phase's media are new to the
server anyway (a per-run nonce enters their seeds), so a missing route leaves the processor
cache warm only for what it already held; the prefix cache may still hold the prompts' text.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from aphrodite_cli.bench.load.wire import request_headers

ROUTES = ("/reset_mm_cache", "/reset_prefix_cache")


async def reset_caches(root: str, api_key: str | None = None, timeout_s: float = 30.0,
                       extra_headers: dict[str, str] | None = None
                       ) -> dict[str, dict[str, Any]]:
    """route -> ``{"status": "reset" | "no cache" | "not reset" | "absent" | "failed", "http": code,
    "detail": what the target said or why}``."""
    headers = request_headers(api_key, extra_headers, json_body=False)
    out: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for route in ROUTES:
            try:
                async with session.post(root + route, headers=headers) as resp:
                    text = (await resp.text(errors="replace"))[:300]
                    code = resp.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                out[route] = {"status": "failed", "http": None, "detail": type(exc).__name__}
                continue
            if code in (404, 405):
                out[route] = {"status": "absent", "http": code,
                              "detail": "the target has no such route: its cache (if any) "
                                        "was not reset"}
            elif code == 200:
                detail: Any = text
                try:
                    import json

                    detail = json.loads(text) if text.strip() else {}
                except ValueError:
                    pass
                status = "reset"
                if isinstance(detail, dict) and detail.get("reset") is False:
                    # no cache at all is as cold as an emptied one; a cache left full is not
                    status = "no cache" if detail.get("has_cache") is False else "not reset"
                out[route] = {"status": status, "http": code, "detail": detail}
            else:
                out[route] = {"status": "failed", "http": code, "detail": text}
    return out


def describe(result: dict[str, dict[str, Any]]) -> str:
    """One line for the console: each route and what came of it."""
    parts = []
    for route, r in result.items():
        note = r["detail"].get("note") if isinstance(r["detail"], dict) else None
        parts.append(f"{route}: {r['status']}" + (f" (HTTP {r['http']})" if r["status"] in (
            "absent", "failed") and r["http"] else "") + (f" ({note})" if note else ""))
    return "; ".join(parts)
