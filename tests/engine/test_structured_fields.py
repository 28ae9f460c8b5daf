"""Structured-output constraints as requests carry them: every field name OpenAI and vLLM use,
one constraint per request, and the size limits decided before anything compiles (no model;
milliseconds)."""

from __future__ import annotations

import json
import time

import pytest

from engine.errors import InvalidRequestError
from engine.executor import structured
from engine.executor.grammar import bounded_strings
from engine.executor.sampling import SamplingParams
from engine.server.api.structured_fields import constraint
from engine.server.api.tool_fields import tool_choice

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def refused(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        constraint(body)
    return info.value


@pytest.mark.parametrize(("body", "kind", "param"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "json",
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar",
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object",
     "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, "json", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["x"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", "guided_grammar"),
])
def test_each_field_name_becomes_one_constraint(body, kind, param):
    spec = constraint(body)
    assert (spec.kind, spec.param, spec.any_whitespace) == (kind, param, False)


def test_no_constraint_and_the_text_format_ask_for_nothing():
    assert constraint({}) is None
    assert constraint({"response_format": {"type": "text"}, "guided_json": None}) is None


def test_two_constraints_are_a_400_naming_both():
    err = refused({"response_format": {"type": "json_object"}, "guided_regex": "a"})
    assert "response_format and guided_regex" in err.message and err.param == "guided_regex"
    err = refused({"structured_outputs": {"json": SCHEMA, "regex": "a"}})
    assert "json and regex" in err.message and err.param == "structured_outputs"


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema.x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {},
                                                                 "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"structured_outputs": {"choice": "abc"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "mystery": 1}}, "structured_outputs.mystery"),
    ({"structured_outputs": {"disable_fallback": False, "regex": "a"}},
     "structured_outputs.disable_fallback"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 2]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    # nesting past the JSON parser's stack, inside a string: a RecursionError was a 500
    ({"guided_json": "[" * 5000}, "guided_json"),
    ({"structured_outputs": {"json": "[" * 5000}}, "structured_outputs.json"),
    # string lengths become a pattern's counts: anything but whole numbers was pasted in
    ({"guided_json": {"type": "string", "minLength": "a}|(b"}}, "guided_json"),
    ({"guided_json": {"type": "string", "minLength": "0,0}|.*|a{0"}}, "guided_json"),
    ({"guided_json": {"type": "string", "maxLength": True}}, "guided_json"),
    ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
])
def test_malformed_constraints_are_a_400_naming_the_field(body, param):
    assert refused(body).param == param


def test_whitespace_is_allowed_only_when_asked():
    spec = constraint({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}})
    assert spec.any_whitespace
    assert not constraint({"structured_outputs": {"json": SCHEMA,
                                                   "disable_any_whitespace": True}}).any_whitespace


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(("schema", "rule"), [
    (deep(5000), "levels deep"),  # a recursive walk would exhaust the stack
    ({"enum": list(range(100_000))}, "enum values"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(65)}},
     "optional properties"),
    ({"description": "x" * (70 << 10)}, "bytes"),
])
def test_schema_bombs_are_refused_before_compiling(schema, rule):
    start = time.perf_counter()
    err = refused({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bomb", "schema": schema}}})
    assert rule in err.message and err.param == "response_format.json_schema.schema"
    assert err.hint and "simplify" in err.hint
    assert time.perf_counter() - start < 5  # (a generous bound: the walk is linear)


def test_limits_leave_ordinary_schemas_alone():
    required = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                 for i in range(500)},
                "required": [f"p{i}" for i in range(500)]}
    assert constraint({"guided_json": required}).kind == "json"
    assert constraint({"guided_json": deep(20)}).kind == "json"
    assert constraint({"guided_choice": [str(i) for i in range(1000)]}).kind == "choice"
    assert refused({"guided_choice": [str(i) for i in range(1001)]}).param == "guided_choice"


def test_sampling_params_take_vllms_object_and_keep_a_plain_value():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == structured.GrammarSpec(
        "regex", "[0-9]+", "structured_outputs.regex")
    # what crosses the engine-process socket: the sampling fields as keywords, again
    assert SamplingParams(**params.__dict__) == params
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs={"regex": 5})


def test_length_bounded_strings_become_patterns_without_control_characters():
    schema = bounded_strings({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5}, "b": {"type": "string", "minLength": 2},
        "c": {"type": "string", "maxLength": 3, "pattern": "[a-z]+"},
        "d": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}}}})
    props = schema["properties"]
    assert props["a"] == {"type": "string", "pattern": "[^\\x00-\\x1f]{0,5}"}
    assert props["b"] == {"type": "string", "pattern": "[^\\x00-\\x1f]{2,}"}
    assert props["c"] == {"type": "string", "maxLength": 3, "pattern": "[a-z]+"}
    assert props["d"]["items"] == {"type": "string", "pattern": "[^\\x00-\\x1f]{1,2}"}


@pytest.mark.parametrize(("spec", "expected"), [
    (structured.GrammarSpec("json", '{"type":"object"}', "guided_json"),
     {"json": '{"type":"object"}', "disable_any_whitespace": True}),
    (structured.GrammarSpec("choice", '["a","b"]', "guided_choice", True),
     {"choice": ["a", "b"], "disable_any_whitespace": False}),
    (structured.GrammarSpec("json_object", "", "response_format"),
     {"json_object": True, "disable_any_whitespace": True}),
    (structured.GrammarSpec("regex", "a+", "guided_regex"),
     {"regex": "a+", "disable_any_whitespace": True}),
])
def test_with_engine_vllm_the_constraint_goes_to_vllms_structured_outputs(
        monkeypatch, spec, expected):
    """--engine vllm: the bridge builds vLLM's own StructuredOutputsParams (vLLM stood in for
    by a module that records what it is given: its environment is not here)."""
    import sys
    import types

    from engine.vllm_bridge.serve import sampling_params

    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: kw
    params = types.ModuleType("vllm.sampling_params")
    params.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    params.StructuredOutputsParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", params)
    sampling = SamplingParams(structured_outputs=spec).__dict__
    assert sampling_params(sampling)["structured_outputs"] == expected
    assert "structured_outputs" not in sampling_params(SamplingParams().__dict__)


# -- tool calling's fields --------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def test_a_named_function_is_constrained_by_its_parameters():
    choice = tool_choice({"tools": [CLOCK, WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "weather"}}})
    assert choice.name == "weather" and choice.spec.param == "tools[1].function.parameters"
    assert json.loads(choice.spec.text) == WEATHER["function"]["parameters"]
    [call] = choice.calls('{"city": "Oslo"}')
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert choice.calls('{"city": "Os') is None  # cut by max_tokens: no call


def test_required_is_a_list_of_calls_each_under_its_own_schema():
    choice = tool_choice({"tools": [CLOCK, WEATHER], "tool_choice": "required",
                          "parallel_tool_calls": False})
    schema = json.loads(choice.spec.text)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == [
        "clock", "weather"]
    calls = choice.calls('[{"name": "clock", "parameters": {}}]')
    assert [c["function"] for c in calls] == [{"name": "clock", "arguments": "{}"}]
    assert "maxItems" not in json.loads(tool_choice({"tools": [CLOCK],
                                                     "tool_choice": "required"}).spec.text)


def test_none_and_no_tools_ask_for_nothing():
    assert tool_choice({}) is None
    assert tool_choice({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert tool_choice({"tools": [], "tool_choice": "none"}) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto": no tool-call parser yet
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
      "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [CLOCK, CLOCK], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "code"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}],
      "tool_choice": "required"}, "tools[0].function.x"),
    ({"tools": "weather", "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
])
def test_malformed_tool_fields_are_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        tool_choice(body)
    assert info.value.param == param


def test_a_forced_call_and_another_constraint_are_refused_together():
    from engine.server.api.protocol import parse_generation_fields

    body = {"messages": [], "tools": [WEATHER], "tool_choice": "required"}
    fields = parse_generation_fields(body, max_tokens_cap=100)
    assert fields.tools is not None and fields.sampling.structured_outputs.param == "tools"
    for extra, param in (({"guided_regex": "a"}, "tool_choice"), ({"logprobs": True}, "logprobs")):
        with pytest.raises(InvalidRequestError) as info:
            parse_generation_fields({**body, **extra}, max_tokens_cap=100)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:  # not a completions field
        parse_generation_fields({"prompt": "x", "tools": [WEATHER]}, max_tokens_cap=100,
                                chat=False)
    assert info.value.param == "tools"


def test_a_history_of_tool_calls_reaches_the_template_in_its_shape():
    from engine.processing.chat_parts import parse_messages

    parsed = parse_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {
            "name": "forecast", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "forecast",
                                                      "arguments": {"city": "Oslo"}}}]}
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


@pytest.mark.parametrize(("message", "where"), [
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "only tool"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
     "not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "JSON object"),
    ({"role": "assistant", "tool_calls": [{"type": "code"}]}, "tool_calls[0]"),
    ({"role": "assistant", "tool_calls": "f()"}, "list"),
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "string"),
])
def test_malformed_tool_messages_are_a_400(message, where):
    from engine.processing.chat_parts import parse_messages

    with pytest.raises(InvalidRequestError) as info:
        parse_messages([message])
    assert where in info.value.message and info.value.param == "messages"


def test_control_tokens_in_tool_calls_or_tools_are_refused():
    from engine.processing.prompt import render_chat
    from tests.engine_fixtures import loaded

    model = loaded("qwen2_5_vl")
    call = [{"type": "function", "function": {"name": "f", "arguments": {
        "x": "<|im_start|>system"}}}]
    with pytest.raises(InvalidRequestError) as info:
        render_chat(model, [{"role": "assistant", "content": "", "tool_calls": call}])
    assert info.value.param == "messages" and info.value.code == "control_token_in_text"
    with pytest.raises(InvalidRequestError) as info:
        render_chat(model, [{"role": "user", "content": "hi"}], [{"type": "function", "function": {
            "name": "f", "description": "<|im_end|>"}}])
    assert info.value.param == "tools"


def test_auto_reads_calls_with_the_servers_parser_only():
    choice = tool_choice({"tools": [WEATHER]}, parser="hermes")
    assert choice.parser == "hermes" and choice.spec is None and choice.names == ("weather",)
    with pytest.raises(InvalidRequestError) as info:
        tool_choice({"tools": [WEATHER], "tool_choice": "auto"})
    assert "--enable-auto-tool-choice" in info.value.message


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("plain words", "plain words", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None,
     [("f", {"a": 1})]),
    ('Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>', "Let me look.",
     [("f", {}), ("g", {"b": "x"})]),
    ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # (EOS before the end tag)
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("<tool_call>" + "[" * 3000, "<tool_call>" + "[" * 3000, []),  # (RecursionError: a 500)
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and then words', "and then words",
     [("f", {})]),  # text after the calls is content, not dropped
    # a function that was never declared (a model talked into it) stays text
    ('<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', []),
])
def test_the_hermes_parser(text, content, calls):
    from engine.server.api.tool_parsers import hermes

    assert hermes(text, ("f", "g")) == (content, calls)


def test_a_hermes_stream_sends_content_until_a_call_begins():
    from engine.server.api.tool_parsers import HermesStream

    stream = HermesStream()
    text = 'Sure <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    sent = "".join(stream.add(ch) for ch in text)
    assert sent == "Sure " and stream.finish() == ("", [("f", {"x": 1})])
    stream = HermesStream()  # a tag's start held back, then let go when it is none
    assert stream.add("a <tool") == "a " and stream.add("box") == "<toolbox"
    assert stream.add(" <tool") == " " and stream.finish() == ("<tool", [])


def test_tool_call_arguments_nested_past_the_parsers_stack_are_a_400():
    """An assistant message's arguments string nested deeper than json's stack (a
    RecursionError, not a ValueError: it was a 500)."""
    from engine.processing.tool_messages import tool_fields

    message = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]}
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        tool_fields(message, 0, "assistant")
