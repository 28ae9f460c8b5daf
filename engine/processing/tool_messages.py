"""A chat history's tool calls, as the chat template reads them: an assistant message's
``tool_calls`` (OpenAI's shape: arguments as a JSON string; templates such as Qwen's write
them from an object, so they are parsed, as vLLM does) and a tool message's
``tool_call_id``. Malformed, or on a role that does not carry them, is a 400 naming the
field."""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError

#: tool calls one assistant message may hold
MAX_CALLS = 128


def _bad(message: str, param: str = "messages") -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_tool_message", param=param)


def tool_fields(message: dict[str, Any], n: int, role: str) -> dict[str, Any]:
    """The tool fields of ``messages[n]`` for the template (empty when it has none)."""
    calls, call_id = message.get("tool_calls"), message.get("tool_call_id")
    out: dict[str, Any] = {}
    if calls is not None:
        if role != "assistant":
            raise _bad(f"messages[{n}].tool_calls: only assistant messages carry tool calls")
        if not isinstance(calls, list) or len(calls) > MAX_CALLS:
            raise _bad(f"messages[{n}].tool_calls must be a list of at most {MAX_CALLS} calls")
        out["tool_calls"] = [_call(call, f"messages[{n}].tool_calls[{k}]")
                             for k, call in enumerate(calls)]
    if call_id is not None:
        if role != "tool":
            raise _bad(f"messages[{n}].tool_call_id: only tool messages answer a call")
        if not isinstance(call_id, str):
            raise _bad(f"messages[{n}].tool_call_id must be a string")
        out["tool_call_id"] = call_id
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function" or \
            not isinstance(function.get("name"), str):
        raise _bad(f'{where} must be {{"type": "function", "function": {{"name", "arguments"}}}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (nesting deeper than the parser's stack)
            raise _bad(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise _bad(f"{where}.function.arguments must be a JSON object")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"],
                                                            "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
