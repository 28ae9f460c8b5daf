"""Structured outputs: the constraint a request puts on its text, as one plain value.

vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) becomes a :class:`GrammarSpec`, checked here for size before anything
compiles it: a schema over :data:`MAX_SPEC_BYTES`, nested deeper than
:data:`MAX_SCHEMA_DEPTH` or with more than :data:`MAX_ENUM_VALUES` enum values (choices
count too), or an object with more than :data:`MAX_OPTIONAL_PROPERTIES` optional properties
(the grammar's size grows with their combinations: 1200 took 30 s to compile) is refused at
once, naming the field it came in. So is a schema whose string ``pattern`` s and lengths
(``minLength``/``maxLength`` become a pattern) repeat more than
:data:`MAX_PATTERN_REPEATS` characters in one pattern or :data:`MAX_SCHEMA_REPEATS` in all
(:func:`pattern_repeats`, nested repetitions multiplied): inside a JSON string xgrammar
expands each repetition, in time that grows with its square (``[^"]{0,5000}``: 15 s on
these CPUs, ten strings of 1000 to 2000 characters: 19 s), and a compile past its deadline
goes on holding a compile thread. A repetition of a part whose own length varies counts its
repetitions squared: the ways to split the text among them multiply (``([^"]{0,40}){40}``,
1600 characters, took 22 s, ``([^"]{0,10}){0,100}`` 24 s, against 2 s for a flat 2048).
A plain regex constraint is not expanded that way (``[^"]{0,5000}`` compiles in 0.1 s) and
has no such cap (what its matcher costs a step is bounded in :mod:`engine.executor.grammar`).
OpenAI's own limits for strict schemas are of the same order (10 levels of nesting, 1000 enum
values, every property required).

The grammar engine's side (compiling, the per-row matchers) is
:mod:`engine.executor.grammar`; the request fields that carry a constraint under OpenAI's and
vLLM's other names (``response_format``, ``guided_json``...) are the server's
(:mod:`engine.server.api.structured_fields`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from engine.errors import InvalidRequestError

#: the constraint kinds, by vLLM's ``structured_outputs`` key
KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: a schema, pattern, grammar or the choices together, as UTF-8 bytes
MAX_SPEC_BYTES = 64 << 10
#: JSON containers inside one another in a schema (OpenAI's 10 levels of objects are ~21)
MAX_SCHEMA_DEPTH = 64
#: ``enum`` and ``const`` values in one schema, or choices
MAX_ENUM_VALUES = 1000
#: properties of one object the schema leaves optional (not in ``required``)
MAX_OPTIONAL_PROPERTIES = 64
#: characters one pattern of a JSON schema may repeat (``[^"]{0,2048}``: about 2 s to compile)
MAX_PATTERN_REPEATS = 2048
#: ... and all its patterns and string lengths together
MAX_SCHEMA_REPEATS = 4096
#: the hint every size refusal carries
LIMITS_HINT = (f"simplify the constraint: at most {MAX_SPEC_BYTES >> 10} KiB, "
               f"{MAX_SCHEMA_DEPTH} levels of nesting, {MAX_ENUM_VALUES} enum values and "
               f"{MAX_OPTIONAL_PROPERTIES} optional properties per object")
#: the hint a refusal of long string patterns carries
REPEATS_HINT = (f"bound strings to at most {MAX_PATTERN_REPEATS} characters each and "
                f"{MAX_SCHEMA_REPEATS} in all (maxLength, or a pattern's repetition counts), "
                "or leave the bound out")
#: keys of vLLM's ``structured_outputs`` this server takes as flags (see :func:`from_fields`)
FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
#: keys vLLM defines that this server does not implement: a value other than null is a 400
NOT_IMPLEMENTED = ("whitespace_pattern", "structural_tag", "backend", "_backend")


class GrammarSpec(NamedTuple):
    """One constraint: ``kind`` (one of :data:`KINDS`), ``text`` (the schema as compact JSON,
    the pattern, the choices as a JSON list, the EBNF grammar; empty for ``json_object``),
    ``param`` (the request field it came in: errors name it) and ``any_whitespace`` (JSON
    kinds: whitespace between tokens allowed; off by default, so JSON comes out compact).
    A plain tuple: it crosses the engine-process socket inside the sampling fields."""

    kind: str
    text: str
    param: str
    any_whitespace: bool = False

    @property
    def key(self) -> tuple[str, str, bool]:
        """What a compiled grammar is cached by (the field it came in does not matter)."""
        return self.kind, self.text, self.any_whitespace


def _bad(param: str, rule: str, *, hint: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {rule}", param=param, hint=hint,
                               code="invalid_structured_output")


def _sized(param: str, text: str) -> str:
    size = len(text.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise _bad(param, f"is {size} bytes; at most {MAX_SPEC_BYTES} are compiled",
                   hint=LIMITS_HINT)
    return text


def schema_spec(schema: Any, param: str, *, any_whitespace: bool = False) -> GrammarSpec:
    """A JSON Schema (an object, or its JSON text) as a ``json`` spec, within the limits."""
    if isinstance(schema, str):
        try:
            schema = json.loads(_sized(param, schema))
        except (ValueError, RecursionError):  # (nesting deeper than the parser's stack)
            raise _bad(param, "is not valid JSON") from None
    if not isinstance(schema, dict):
        raise _bad(param, "must be a JSON Schema object")
    check_schema(schema, param)
    _check_repeats(schema, param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return GrammarSpec("json", _sized(param, text), param, any_whitespace)


def check_schema(schema: dict[str, Any], param: str) -> None:
    """The schema's nesting, enum values and optional properties within the limits (one walk,
    no recursion: a deep schema cannot exhaust the stack)."""
    enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _bad(param, f"nests more than {MAX_SCHEMA_DEPTH} levels deep",
                       hint=LIMITS_HINT)
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        values = node.get("enum")
        enums += (len(values) if isinstance(values, list) else 0) + ("const" in node)
        if enums > MAX_ENUM_VALUES:
            raise _bad(param, f"holds more than {MAX_ENUM_VALUES} enum values",
                       hint=LIMITS_HINT)
        if node.get("type") == "string":
            _check_lengths(node, param)
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            needed = set(required) if isinstance(required, list) and all(
                isinstance(r, str) for r in required) else set()
            optional = len(set(properties) - needed)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise _bad(param, f"has an object with {optional} optional properties; at "
                                  f"most {MAX_OPTIONAL_PROPERTIES}", hint=LIMITS_HINT)
        stack.extend((v, depth + 1) for v in node.values())


def _check_lengths(node: dict[str, Any], param: str) -> None:
    """A string's ``minLength``/``maxLength``: whole numbers, min at most max (they become a
    pattern's repetition counts, see ``grammar.bounded_strings``: anything else would be
    pasted into that pattern)."""
    low, high = node.get("minLength", 0), node.get("maxLength", 0)
    for name in ("minLength", "maxLength"):
        value = node.get(name, 0)
        if type(value) is not int or value < 0:
            raise _bad(param, f"has a string {name} that is not a whole number, 0 or more")
    if "maxLength" in node and low > high:
        raise _bad(param, "has a string whose minLength is more than its maxLength")


def pattern_repeats(pattern: str) -> int:
    """How many characters ``pattern`` spells out once its counted repetitions are expanded
    (``a{3}b`` 4, ``(ab{9}){10}`` 100, ``a*`` 1), a repetition of a part of varying length
    counting its repetitions squared (``(ab{0,9}){10}`` 1000): what xgrammar's compile of a
    JSON string pattern grows with. A pattern Python's parser does not read counts its
    repetition bounds added up."""
    import re._parser as sre  # (the stdlib's own parser; no public name)

    try:
        return _expanded(sre.parse(pattern), sre)
    except (re.error, RecursionError, OverflowError, ValueError, TypeError):
        counts = re.findall(r"\{(\d{1,9})(?:,(\d{0,9}))?\}", pattern)
        return sum(max(int(low), int(high or 0)) for low, high in counts) + len(pattern)


def _varies(items: Any, sre: Any) -> bool:
    """Whether a parsed pattern holds a repetition of varying count (its length varies)."""
    for op, arg in items:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            parts, varies = [arg[2]], arg[0] != arg[1]
        elif op in (sre.SUBPATTERN, sre.ATOMIC_GROUP):
            parts, varies = [arg[-1]], False
        elif op == sre.BRANCH:
            parts, varies = list(arg[1]), False
        else:
            continue
        if varies or any(_varies(part, sre) for part in parts):
            return True
    return False


def _expanded(items: Any, sre: Any) -> int:
    total = 0
    for op, arg in items:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, high, sub = arg
            times = max(low if high == sre.MAXREPEAT else high, 1)
            if times > 1 and _varies(sub, sre):  # the ways to split the text multiply
                times *= times
            total += times * _expanded(sub, sre)
        elif op in (sre.SUBPATTERN, sre.ATOMIC_GROUP):
            total += _expanded(arg[-1], sre)
        elif op == sre.BRANCH:
            total += sum(_expanded(branch, sre) for branch in arg[1])
        elif op == sre.ASSERT or op == sre.ASSERT_NOT:
            total += _expanded(arg[1], sre)
        else:
            total += 1
    return total


def schema_objects(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object of a JSON schema, depth first, without recursion (a deep schema cannot
    exhaust the stack); an object's values are visited after the caller had it, so a caller
    may rewrite it first."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            stack.extend(node.values())


def _check_repeats(schema: dict[str, Any], param: str) -> None:
    """Every string ``pattern`` and length of ``schema`` within :data:`MAX_PATTERN_REPEATS`,
    all of them within :data:`MAX_SCHEMA_REPEATS` (one walk, no recursion)."""
    total = 0
    for node in schema_objects(schema):
        pattern = node.get("pattern")
        size = pattern_repeats(pattern) if isinstance(pattern, str) else 0
        if node.get("type") == "string" and pattern is None:
            size = max(node.get("minLength", 0), node.get("maxLength", 0))  # (checked ints)
        if size > MAX_PATTERN_REPEATS:
            raise _bad(param, f"has a string pattern or length that spells out {size} "
                              f"characters; at most {MAX_PATTERN_REPEATS} per string",
                       hint=REPEATS_HINT)
        total += size
        if total > MAX_SCHEMA_REPEATS:
            raise _bad(param, f"has string patterns and lengths that spell out more than "
                              f"{MAX_SCHEMA_REPEATS} characters together", hint=REPEATS_HINT)


def regex_spec(pattern: Any, param: str) -> GrammarSpec:
    if not isinstance(pattern, str) or not pattern:
        raise _bad(param, "must be a non-empty string (a regular expression)")
    return GrammarSpec("regex", _sized(param, pattern), param)


def choice_spec(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise _bad(param, "must be a non-empty list of non-empty strings")
    if len(choices) > MAX_ENUM_VALUES:
        raise _bad(param, f"holds {len(choices)} choices; at most {MAX_ENUM_VALUES}",
                   hint=LIMITS_HINT)
    return GrammarSpec("choice", _sized(param, json.dumps(choices, ensure_ascii=False)), param)


def grammar_spec(grammar: Any, param: str) -> GrammarSpec:
    if not isinstance(grammar, str) or not grammar.strip():
        raise _bad(param, "must be a non-empty string (an EBNF grammar with a root rule)")
    return GrammarSpec("grammar", _sized(param, grammar), param)


def json_object_spec(param: str, *, any_whitespace: bool = False) -> GrammarSpec:
    """Any JSON object (OpenAI's ``response_format`` ``json_object``)."""
    return GrammarSpec("json_object", "", param, any_whitespace)


def from_fields(value: Any, param: str = "structured_outputs") -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object as a spec (None: it asks for nothing). Exactly
    one of :data:`KINDS`; ``disable_any_whitespace`` (default true here: compact JSON, since a
    model free to add whitespace may add it without end; false allows it),
    ``disable_fallback`` and ``disable_additional_properties`` (true: what this server does
    anyway) are flags; other keys are a 400 naming them."""
    if isinstance(value, GrammarSpec):
        return value
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(param, "must be an object such as {\"json\": {...}}")
    for key, given in value.items():
        if key in KINDS or given is None:
            continue
        if key in FLAGS:
            if not isinstance(given, bool):
                raise _bad(f"{param}.{key}", "must be true or false")
            if key != "disable_any_whitespace" and not given:
                raise _bad(f"{param}.{key}", "false is not supported: this server has one "
                                             "grammar backend and never adds properties a "
                                             "schema does not allow",
                           hint=f"leave {param}.{key} out")
            continue
        known = key in NOT_IMPLEMENTED
        raise InvalidRequestError(
            f"{param}.{key} is {'not supported by this server' if known else 'unknown'}",
            param=f"{param}.{key}", code="unsupported_parameter",
            hint=f"leave it out; {param} takes one of {', '.join(KINDS)}")
    asked = [k for k in KINDS if value.get(k) not in (None, False)]
    if not asked:
        raise _bad(param, f"asks for nothing: give one of {', '.join(KINDS)}")
    if len(asked) > 1:
        raise _bad(param, f"asks for {' and '.join(asked)}: one constraint per request")
    kind = asked[0]
    loose = value.get("disable_any_whitespace") is False
    where = f"{param}.{kind}"
    if kind == "json":
        return schema_spec(value["json"], where, any_whitespace=loose)
    if kind == "json_object":
        if value["json_object"] is not True:
            raise _bad(where, "must be true or false")
        return json_object_spec(where, any_whitespace=loose)
    return {"regex": regex_spec, "choice": choice_spec, "grammar": grammar_spec}[kind](
        value[kind], where)
