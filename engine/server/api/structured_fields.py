"""The request fields that carry a structured-output constraint, under OpenAI's and vLLM's
names: ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object and its older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``.
One constraint per request: two fields asking for one are a 400 naming both. Each becomes a
:class:`~engine.executor.structured.GrammarSpec` (sizes checked there); compiling it is the
:class:`~engine.executor.grammar.Grammars`' job, before the request queues.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.executor import structured
from engine.executor.structured import GrammarSpec

#: vLLM's older fields, each one kind of constraint
GUIDED = {"guided_json": structured.schema_spec, "guided_regex": structured.regex_spec,
          "guided_choice": structured.choice_spec, "guided_grammar": structured.grammar_spec}
#: OpenAI's ``response_format.json_schema`` keys
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _unsupported(param: str, hint: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} is not supported by this server", param=param,
                               code="unsupported_parameter", hint=hint)


def response_format(value: Any) -> GrammarSpec | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type":
    "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}`` (the schema is enforced whether or not ``strict`` is true,
    as vLLM does)."""
    if value is None:
        return None
    kinds = "text, json_object or json_schema"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError(f"response_format must be an object whose type is {kinds}",
                                  param="response_format")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise _unsupported(f"response_format.{extra[0]}",
                           "response_format takes type and, for json_schema, json_schema")
    if kind != "json_schema" and value.get("json_schema") is not None:
        raise InvalidRequestError(f"response_format.json_schema goes with type json_schema, not "
                                  f"{kind!r}", param="response_format.json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return structured.json_object_spec("response_format")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type={kind!r} is not one of {kinds}",
                                  param="response_format.type", code="unsupported_parameter",
                                  hint="use json_schema (or structured_outputs)")
    param = "response_format.json_schema"
    body = value.get("json_schema")
    if not isinstance(body, dict) or "schema" not in body:
        raise InvalidRequestError(f"{param} must be an object holding the schema: "
                                  '{"name": ..., "schema": {...}}', param=param)
    extra = sorted(set(body) - set(JSON_SCHEMA_KEYS))
    if extra:
        raise _unsupported(f"{param}.{extra[0]}", f"{param} takes "
                                                  f"{', '.join(JSON_SCHEMA_KEYS)}")
    for key, kind_of in (("name", str), ("description", str), ("strict", bool)):
        if body.get(key) is not None and not isinstance(body[key], kind_of):
            raise InvalidRequestError(f"{param}.{key} must be a {kind_of.__name__}",
                                      param=f"{param}.{key}")
    return structured.schema_spec(body["schema"], f"{param}.schema")


def constraint(body: dict[str, Any]) -> GrammarSpec | None:
    """The one constraint ``body`` asks for (None: none), from whichever field carries it."""
    found: list[GrammarSpec] = []
    spec = response_format(body.get("response_format"))
    if spec is not None:
        found.append(spec)
    spec = structured.from_fields(body.get("structured_outputs"))
    if spec is not None:
        found.append(spec)
    for name, make in GUIDED.items():
        if body.get(name) is not None:
            found.append(make(body[name], name))
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "auto", "xgrammar"):
        raise InvalidRequestError(f"guided_decoding_backend={backend!r}: this server's grammar "
                                  "engine is xgrammar", param="guided_decoding_backend",
                                  code="unsupported_parameter", hint="leave it out")
    if body.get("guided_whitespace_pattern") is not None:
        raise _unsupported("guided_whitespace_pattern", "leave it out (JSON comes out compact; "
                                                        "structured_outputs."
                                                        "disable_any_whitespace=false allows "
                                                        "whitespace)")
    if len(found) > 1:
        names = " and ".join(s.param for s in found)
        raise InvalidRequestError(f"{names} each ask for a constraint: one per request",
                                  param=found[1].param, code="invalid_structured_output",
                                  hint="send one of them")
    return found[0] if found else None
