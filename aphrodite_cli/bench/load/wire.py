"""What ``bench serve`` puts on the wire besides its own request: ``--header K=V`` (repeatable)
and ``--extra-body JSON`` (vLLM's names) on every request, and which requests
``--request-cancellation-rate`` cuts (AIPerf's name).

Both are checked once, from the flags, before anything is sent: a header is an HTTP token name
and a value without CR, LF or other control characters (a newline in a value would start a
header, or a body, of the user's making); the extra body is a JSON object none of whose fields
is one the benchmark sets itself (a second ``max_tokens`` or ``stream`` would change what is
measured without the result saying so): such a field is an error naming the flag that sets it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from engine.errors import ConfigError

#: Body fields the benchmark sets itself -> the flag that sets them.
BENCH_FIELDS = {
    "model": "--model", "messages": "--dataset", "prompt": "--dataset",
    "max_tokens": "--output-len", "max_completion_tokens": "--output-len",
    "temperature": "--temperature", "ignore_eos": "--ignore-eos/--no-ignore-eos",
    "stream": "bench serve itself (it times a stream)",
    "stream_options": "bench serve itself (it reads the usage chunk)",
}
#: Headers the benchmark or its HTTP client sets -> who sets them.
BENCH_HEADERS = {
    "content-type": "bench serve itself (application/json)",
    "content-length": "the HTTP client", "transfer-encoding": "the HTTP client",
    "host": "the HTTP client (from --base-url)", "connection": "the HTTP client",
}
#: RFC 9110's token: the characters a header name may hold
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Control characters a header value may not hold (a tab is allowed)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def parse_headers(items: Iterable[str], api_key: str | None = None) -> dict[str, str]:
    """``--header K=V`` items -> a dict, names as given; every bad one is a one-line error."""
    headers: dict[str, str] = {}
    seen: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        shown = json.dumps(item)[:120]
        if not eq or not name:
            raise ConfigError(f"--header {shown} is not KEY=VALUE",
                              hint="e.g. --header X-Tenant=team-a (repeat the flag for more)",
                              code="invalid_flag")
        if not _TOKEN.fullmatch(name):
            raise ConfigError(f"--header {shown}: the name holds characters an HTTP header "
                              "name may not (letters, digits and !#$%&'*+-.^_`|~ only)",
                              code="invalid_flag")
        if _CONTROL.search(value):
            raise ConfigError(f"--header {shown}: the value holds a CR, LF or another "
                              "control character, which would split the request's headers",
                              code="invalid_flag")
        key = name.lower()
        if key in BENCH_HEADERS:
            raise ConfigError(f"--header {name} is set by {BENCH_HEADERS[key]}",
                              hint=f"leave --header {name} out", code="invalid_flag")
        if key == "authorization" and api_key:
            raise ConfigError("--header Authorization and --api-key both set the "
                              "Authorization header", hint="pass one of them",
                              code="invalid_flag")
        if key in seen:
            raise ConfigError(f"--header {name} is given twice ({seen[key]} and {shown})",
                              hint="give each header once", code="invalid_flag")
        seen[key] = shown
        headers[name] = value
    return headers


def request_headers(api_key: str | None, extra: dict[str, str] | None = None, *,
                    json_body: bool = True) -> dict[str, str]:
    """The headers every request to the target carries: the user's ``--header`` ones, the
    bearer key, and (for a POST of JSON) the content type."""
    headers = dict(extra or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if json_body:
        headers["Content-Type"] = "application/json"
    return headers


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body JSON`` -> a dict merged into every request's body (none: ``{}``)."""
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        where = f" ({exc.msg} at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) \
            else ""
        raise ConfigError(f"--extra-body is not JSON{where}",
                          hint='e.g. --extra-body \'{"chat_template_kwargs": '
                               '{"enable_thinking": false}}\'', code="invalid_flag") from None
    if not isinstance(body, dict):
        raise ConfigError(f"--extra-body is a JSON {type(body).__name__}, not an object",
                          hint='e.g. --extra-body \'{"cache_salt": "run-1"}\'',
                          code="invalid_flag")
    clash = [k for k in body if k in BENCH_FIELDS]
    if clash:
        field = clash[0]
        raise ConfigError(f"--extra-body sets {field!r}, which {BENCH_FIELDS[field]} sets",
                          hint=f"use {BENCH_FIELDS[field]}, or leave {field!r} out of "
                               "--extra-body" if BENCH_FIELDS[field].startswith("--")
                          else f"leave {field!r} out of --extra-body", code="invalid_flag")
    return body


def cancelled_indices(n: int, rate_percent: float, seed: int) -> frozenset[int]:
    """Which of n requests ``--request-cancellation-rate`` cuts: round(n x rate / 100) of
    them, drawn with the run's seed (the same seed cuts the same requests)."""
    count = round(n * rate_percent / 100)
    if count <= 0:
        return frozenset()
    rng = np.random.default_rng(seed + 15485863)
    return frozenset(int(i) for i in rng.choice(n, size=min(count, n), replace=False))
