"""Tool calling's request fields (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``)
and the answer's ``tool_calls``.

A forced call is constrained by the grammar engine, so it always parses: a named function
(``tool_choice: {"type": "function", "function": {"name": ...}}``) generates that function's
arguments under its ``parameters`` schema; ``required`` generates a JSON list of
``{"name", "parameters"}`` calls (one at most with ``parallel_tool_calls`` false), each
under its own function's schema, as vLLM does. ``none`` generates text. ``auto`` (the default
when ``tools`` are given) needs a tool-call parser reading the model's own call format, which
the server must be started with (vLLM's flags ``--enable-auto-tool-choice --tool-call-parser
hermes``; :mod:`engine.server.api.tool_parsers`): without them a 400 naming ``tool_choice``,
never text as if the tools had been offered.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.executor import structured
from engine.executor.structured import GrammarSpec

#: tools one request may declare
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True)
class ToolChoice:
    """What a request with tools asks for: a forced call (``name``: a named function; None
    with ``required``: any of ``names``) and its grammar ``spec``, or (``parser`` set, no
    spec) the calls the model may write in that parser's format (``auto``)."""

    name: str | None
    names: tuple[str, ...]
    spec: GrammarSpec | None
    parser: str | None = None

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """A forced call's ``tool_calls`` in OpenAI's shape, or None when ``text`` is not a
        whole call (max_tokens cut it)."""
        try:
            value = json.loads(text)
            if self.name is not None:
                return openai_calls([(self.name, value)])
            return openai_calls([(c["name"], c["parameters"]) for c in value])
        except (ValueError, TypeError, KeyError):  # (a stop string may cut it anywhere)
            return None


def openai_calls(pairs: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """(name, arguments) pairs as OpenAI's ``tool_calls`` (arguments as a JSON string)."""
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)}} for name, args in pairs]


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_tools")


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """``tools`` checked: each function's name and its parameters schema (an object)."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                tool.get("function"), dict) or set(tool) - {"type", "function"}:
            raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        extra = sorted(set(function) - set(_FUNCTION_KEYS))
        if extra:
            raise _bad(f"{where}.function.{extra[0]} is unknown", f"{where}.function.{extra[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1-64 letters, digits, _ or -",
                       f"{where}.function.name")
        if name in functions:
            raise _bad(f"{where}.function.name {name!r} is declared twice",
                       f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters must be a JSON Schema object",
                       f"{where}.function.parameters")
        if function.get("description") is not None and not isinstance(
                function["description"], str):
            raise _bad(f"{where}.function.description must be a string",
                       f"{where}.function.description")
        functions[name] = parameters
    return functions


def tool_choice(body: dict[str, Any], parser: str | None = None) -> ToolChoice | None:
    """What ``body``'s tools ask for (None: none, or no tools); ``parser``: the server's
    tool-call parser for ``auto`` (None: ``auto`` is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    functions = _functions(tools) if tools not in (None, []) else {}
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise _bad(f"tool_choice={choice!r} needs tools", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser", param="tool_choice",
                code="unsupported_parameter",
                hint='start it with --enable-auto-tool-choice --tool-call-parser hermes, or '
                     'send tool_choice "required", a named function, or "none"')
        return ToolChoice(None, tuple(functions), None, parser)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": parameters},
                  "required": ["name", "parameters"]} for name, parameters in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolChoice(None, tuple(functions), structured.schema_spec(schema, "tools"))
    named = choice.get("function") if isinstance(choice, dict) and choice.get(
        "type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   '"function": {"name": ...}}', "tool_choice")
    if name not in functions:
        raise _bad(f"tool_choice names {name!r}, which is not among the tools",
                   "tool_choice.function.name")
    index = list(functions).index(name)
    return ToolChoice(name, (name,), structured.schema_spec(
        functions[name], f"tools[{index}].function.parameters"))
