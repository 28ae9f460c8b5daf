"""Structured outputs on the tiny random-weight Qwen2.5-VL, at temperature 1: whatever the
model would say, the grammar engine's mask leaves only what the constraint allows, so every
finished answer parses and validates (the validator below shares no code with the engine);
a row that reaches max_tokens first ends with "length". Offline (``LLM``, one batch of 100
rows) and served (a real `aphrodite serve` and the `openai` client, streaming and not), on
this project's engine and on vLLM's (``--engine vllm``: vLLM's own structured output)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError, OverloadedError
from engine.executor.grammar import Grammars
from engine.executor.structured import GrammarSpec, pattern_repeats, regex_spec, schema_spec
from engine.models.templates_path import template_path
from tests.engine.test_structured_fields import deep as nested
from tests.engine_fixtures import llm as shared_llm
from tests.engine_fixtures import loaded
from tests.engines import ENGINES, TOOLS_SERVER
from tests.server_harness import openai_client

#: the served tests run on both engines (vLLM's under this server's front door)
pytestmark = [pytest.mark.timeout(300), pytest.mark.engines(*ENGINES),
              pytest.mark.serve(*TOOLS_SERVER)]
MODEL = "tiny-qwen2_5_vl"
README = Path(__file__).resolve().parents[2] / "docs" / "serving.md"

#: short keys: the tiny model's 449-token vocabulary spends about a token per character
SCHEMA = {
    "type": "object",
    "properties": {
        "nm": {"type": "string", "maxLength": 3},
        "k": {"enum": ["cat", "dog", "bird"]},
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "t": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "o": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "z": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["id", "z"]},
    },
    "required": ["nm", "k", "a", "t", "o"],
}
CHOICES = ["yes", "no", "maybe later", 'say "hi"']
REGEX = r"[a-z]{2,6}@(ex|ample)\.(com|org)"


def valid(value, schema: dict) -> bool:
    """The JSON Schema keywords :data:`SCHEMA` uses, checked by hand (no properties beyond
    those declared: the grammar never adds any)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return isinstance(value, dict) and set(value) <= set(props) and all(
            k in value for k in schema.get("required", ())) and all(
            valid(v, props[k]) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30) and \
            all(valid(v, schema["items"]) for v in value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30) and (
            "pattern" not in schema or re.search(schema["pattern"], value) is not None)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"the validator does not know {kind}")


def check_json(outputs: list[tuple[str, str]]) -> int:
    """Every finished answer parses and validates; those cut by max_tokens end "length".
    The number finished."""
    finished = 0
    for text, reason in outputs:
        assert reason in ("stop", "length"), reason
        if reason == "stop":
            assert valid(json.loads(text), SCHEMA), text
            finished += 1
    return finished


@pytest.fixture(scope="module")
def wide_llm():
    """The tiny model with room for 100 rows in one running batch (one batch, a few s)."""
    engine = LLM("tiny:qwen2_5_vl", max_num_seqs=100, enable_prefix_caching=False)
    yield engine
    engine.close()


def test_a_batch_of_100_json_answers_all_parse_and_validate(wide_llm):
    """The done-when: 100 rows at temperature 1 with a nested schema (objects, arrays, enums,
    required fields, an optional one); each finished row is valid JSON of the schema."""
    params = SamplingParams(max_tokens=96, n=10, seed=7, temperature=1.0,
                            structured_outputs={"json": SCHEMA})
    results = wide_llm.generate([f"Record {i} as JSON:" for i in range(10)], params)
    outputs = [(o.text, o.finish_reason) for r in results for o in r.outputs]
    assert len(outputs) == 100
    assert check_json(outputs) >= 90  # (the few cut by max_tokens end "length")


def test_a_row_that_reaches_max_tokens_ends_length(wide_llm):
    results = wide_llm.generate("JSON:", SamplingParams(
        max_tokens=6, n=4, seed=1, structured_outputs={"json": SCHEMA}))
    for out in results[0].outputs:
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        assert out.text.startswith('{"')  # (a prefix of the schema's JSON)


def test_choices_and_patterns_always_match(wide_llm):
    results = wide_llm.generate(["Pick one:", "Email:"], [
        SamplingParams(max_tokens=16, n=16, seed=3, structured_outputs={"choice": CHOICES}),
        SamplingParams(max_tokens=24, n=16, seed=4, structured_outputs={"regex": REGEX})])
    assert {(o.text, o.finish_reason) for o in results[0].outputs} <= {
        (c, "stop") for c in CHOICES}
    for out in results[1].outputs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


def test_rows_without_a_grammar_share_the_step_untouched():
    """A plain greedy row beside constrained rows in the same decode steps says exactly what
    it says alone."""
    llm = shared_llm("qwen2_5_vl")
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate("Say something.", plain)[0].outputs[0].token_ids
    mixed = llm.generate(["Say something.", "JSON:", "Pick:"], [
        plain, SamplingParams(max_tokens=8, n=3, structured_outputs={"json": SCHEMA}),
        SamplingParams(max_tokens=16, seed=5, structured_outputs={"choice": CHOICES})])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[2].outputs[0].text in CHOICES


def test_a_bad_constraint_raises_before_any_row_runs():
    llm = shared_llm("qwen2_5_vl")
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(
            structured_outputs={"grammar": "root ::= undefined_rule"})])
    assert info.value.param == "structured_outputs.grammar"
    assert "undefined_rule" in info.value.message and "/" not in info.value.message


def slow_spec(tag: str) -> GrammarSpec:
    """A constraint that takes the grammar compiler a while (1000 long enum values: 0.2 s
    here), within the size limits."""
    values = [f"{tag}{'x' * 50}{i}" for i in range(1000)]
    return GrammarSpec("json", json.dumps({"enum": values}), "guided_json")


def test_compiles_are_bounded_in_time_cached_and_evicted():
    tokenizer = loaded("qwen2_5_vl").tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], entries=2,
                        threads=1)
    try:
        slow = slow_spec("a")
        with pytest.raises(InvalidRequestError) as info:  # started, ran past the deadline
            grammars.check(slow, timeout_s=0.001)
        assert info.value.param == "guided_json" and "longer than" in info.value.message
        # the one compile thread is busy with it: another constraint cannot even start
        with pytest.raises(OverloadedError):
            grammars.check(slow_spec("b"), timeout_s=0.001)
        assert grammars.check(slow, timeout_s=60) is not None  # it finished: cached
        assert grammars.stats == {"compiles": 2, "hits": 1}
        grammars.check(GrammarSpec("regex", "a+", "guided_regex"))
        grammars.check(slow)  # still cached: no compile
        assert grammars.stats["compiles"] == 3
        grammars.check(GrammarSpec("regex", "b+", "guided_regex"))  # 2 entries at most
        grammars.check(GrammarSpec("regex", "a+", "guided_regex"))
        assert grammars.stats["compiles"] == 5
    finally:
        grammars.close()


# -- served ----------------------------------------------------------------------------------

@pytest.fixture
def server(served):
    """Ours, or vLLM's engine under this server's front door (tests/engines.py): the
    constraint goes to vLLM's own structured output (StructuredOutputsParams on xgrammar),
    the tools template and the hermes parser stay this server's (the server of the module's
    ``serve`` mark, shared with tests/vllm's TestQwen25VL)."""
    return served


@pytest.fixture
def client(server):
    return openai_client(server)


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                          "strict": True}}


def test_served_json_schema_answers_validate(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A pet as JSON."}], n=8,
        temperature=1.0, max_tokens=96, seed=11, response_format=RESPONSE_FORMAT)
    outputs = [(c.message.content, c.finish_reason) for c in reply.choices]
    assert len(outputs) == 8 and check_json(outputs) >= 6


def test_served_streams_validate_too(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A pet as JSON."}], n=4,
        temperature=1.0, max_tokens=96, seed=12, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    texts, reasons = ["", "", "", ""], [None] * 4
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert check_json(list(zip(texts, reasons, strict=True))) >= 3
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Email?"}], n=4, max_tokens=24,
        stream=True, extra_body={"guided_regex": REGEX})
    texts = ["", "", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(re.fullmatch(REGEX, t) for t in texts), texts


def test_text_completions_take_constraints(client):
    reply = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=16, n=8,
                                      extra_body={"guided_choice": CHOICES})
    assert {(c.text, c.finish_reason) for c in reply.choices} <= {(c, "stop") for c in CHOICES}


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
])
def test_served_bad_constraints_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": "hi"}], extra_body=extra)
    assert info.value.body["param"] == param
    assert "Traceback" not in info.value.body["message"] and ".cc" not in \
        info.value.body["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"json": json.dumps(nested(200))}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {
        "enum": [f"v{i}" for i in range(50_000)]}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {
        "type": "string", "pattern": '[^"]{0,5000}'}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "minLength": 1000 + i, "maxLength": 2000 + i}
        for i in range(10)}}}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 5000}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
], ids=["deep", "huge-enum", "long-pattern", "many-long-strings", "tool-long-string"])
def test_served_schema_bombs_are_refused_in_bounded_time(client, extra, param):
    """Unchecked, each would hold a compile thread for seconds to minutes (a JSON string
    pattern of 5000 repetitions: 15 s; ten strings of 1000-2000 characters: 19 s, past the
    10 s deadline, compiling on after its 400). (An object nested deeper than 64 levels in
    the body is refused by the front door already.)"""
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": "hi"}], extra_body=extra)
    assert info.value.body["param"] == param
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "string", "pattern": '[^"]{0,5000}'}, "spells out 5000 characters"),
    ({"type": "string", "pattern": "([a-z]{0,100}x){0,100}"}, "spells out 1010000 characters"),
    # a repetition of a part of varying length: 1600 characters, 22 s to compile
    ({"type": "string", "pattern": '([^"]{0,40}){40}'}, "spells out 64000 characters"),
    ({"type": "string", "pattern": '([^"]{0,10}){0,100}'}, "spells out 100000 characters"),
    ({"type": "string", "maxLength": 3000}, "spells out 3000 characters"),
    ({"type": "array", "items": [{"type": "string", "minLength": 1500, "maxLength": 1500}] * 3},
     "more than 4096 characters together"),
])
def test_long_json_string_patterns_are_refused_before_any_compile(schema, says):
    """What xgrammar expands inside a JSON string, in time growing with its square, is
    measured from the schema alone (no compile) and refused naming the field and the rule."""
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=says) as info:
        schema_spec(schema, "response_format.json_schema.schema")
    assert info.value.param == "response_format.json_schema.schema"
    assert "maxLength" in info.value.hint and time.perf_counter() - start < 0.5


def test_bounded_strings_and_plain_regexes_within_the_caps_are_taken():
    assert schema_spec({"type": "string", "maxLength": 2048}, "p").kind == "json"
    assert schema_spec({"type": "string", "pattern": "[a-z]{3}-[0-9]{4}"}, "p").kind == "json"
    assert regex_spec('[^"]{0,5000}', "p").kind == "regex"  # a plain regex is not expanded
    assert pattern_repeats("(ab{9}){10}") == 100 and pattern_repeats("a*b+") == 2
    assert pattern_repeats("(ab{0,9}){10}") == 1000  # varying parts: repetitions squared
    ip = r"(\d{1,3}\.){3}\d{1,3}"  # (a common shape stays small)
    assert pattern_repeats(ip) == 39 and schema_spec({"type": "string", "pattern": ip}, "p")


def test_readme_structured_outputs_example_runs(server):
    text = README.read_text()
    block = text[text.index("<!-- structured-outputs-example:start -->"):
                 text.index("<!-- structured-outputs-example:end -->")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", block, re.S))
    scope: dict = {}
    exec(code.replace("localhost:2242", f"localhost:{server.port}"), scope)
    assert isinstance(json.loads(scope["reply"].choices[0].message.content), dict) or \
        scope["reply"].choices[0].finish_reason == "length"
    assert scope["call"].function.name == "forecast"
    assert set(json.loads(scope["call"].function.arguments)) == {"city", "days"}


def test_readme_sampling_parameters_examples_run(server):
    """The README's sampling-parameters examples (openai client and curl), on this module's
    server."""
    import subprocess

    text = README.read_text()
    block = text[text.index("<!-- sampling-params-example:start -->"):
                 text.index("<!-- sampling-params-example:end -->")]
    port = f"localhost:{server.port}"
    scope: dict = {}
    exec(re.search(r"```python\n(.*?)```", block, re.S).group(1).replace(
        "localhost:2242", port), scope)
    reply = scope["reply"]
    assert reply.usage.completion_tokens >= 4  # min_tokens
    assert "grey" not in reply.choices[0].message.content
    curl = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    done = subprocess.run(["bash", "-c", curl.replace("localhost:2242", port)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["usage"]["completion_tokens"] > 0


def test_the_mask_covers_padded_logits_and_leaves_plain_rows_alone():
    """Logits wider than the grammar's vocabulary (a model's padded embedding) have the extra
    columns masked in constrained rows; plain and finished rows keep every logit; bfloat16
    logits are masked in their own dtype."""
    import torch

    from engine.executor.grammar import mask_logits

    tokenizer = loaded("qwen2_5_vl").tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1)
    try:
        compiled = grammars.check(GrammarSpec("choice", json.dumps(["yes"]), "guided_choice"))

        class Row:
            def __init__(self, grammar, done=False):
                self.request = type("Request", (), {"grammar": grammar, "error": None})()
                self.done, self.matcher = done, None

        for dtype in (torch.float32, torch.bfloat16):
            rows = [Row(None), Row(compiled), Row(compiled, done=True)]
            logits = torch.zeros(3, len(tokenizer) + 23, dtype=dtype)
            assert mask_logits(rows, logits, grammars) is logits
            allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
            assert [tokenizer.decode([t]) for t in allowed] and all(
                "yes".startswith(tokenizer.decode([t])) for t in allowed)
            assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
            assert rows[1].matcher is not None and rows[2].matcher is None
    finally:
        grammars.close()


def test_a_constraint_whose_masks_grow_costly_fails_its_request_alone(monkeypatch):
    """``(.{0,100}){0,100}`` compiles at once, but its matcher tracks ever more ways to have
    matched as the text grows: unchecked, its mask took 0.2 s a step by step 100 and 2 s by
    step 400, every batch-mate waiting. Charged its own time on slow steps, the row fails its
    request with a 400 naming the field once over the budget (lowered here, so the test is
    short), its other row ends with it, and a plain constrained row in the same steps goes on,
    charged nothing."""
    import random
    from types import SimpleNamespace

    import torch

    from engine.executor import grammar
    from engine.executor.row import Row

    monkeypatch.setattr(grammar, "MAX_REQUEST_MASK_S", 0.3, raising=False)
    tokenizer = loaded("qwen2_5_vl").tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1)
    try:
        def request(kind, text, param):
            spec = GrammarSpec(kind, text, param)
            return SimpleNamespace(grammar=grammars.check(spec), error=None, cancelled=None,
                                   grammar_s=0.0, params=SimpleNamespace(structured_outputs=spec))

        bomb = request("regex", "(.{0,100}){0,100}", "guided_regex")
        plain = request("regex", "[a-z ]{0,4000}", "structured_outputs.regex")
        rows = [Row(bomb, 0, None), Row(bomb, 1, None), Row(plain, 0, None)]
        rng = random.Random(0)
        for _ in range(400):
            logits = torch.zeros(len(rows), len(tokenizer))
            grammar.mask_logits(rows, logits, grammars)
            if bomb.error is not None:
                break
            for i, row in enumerate(rows):
                allowed = [t for t in torch.isfinite(logits[i]).nonzero().flatten().tolist()
                           if t != tokenizer.eos_token_id]
                assert not row.done and grammar.accept(row, rng.choice(allowed)) is False
        error = bomb.error
        assert isinstance(error, InvalidRequestError) and error.status == 400
        assert error.param == "guided_regex" and error.code == "invalid_structured_output"
        assert "grammar work" in error.message and "(.{0,9}){0,9}" in error.hint
        assert rows[0].done and rows[1].done and not rows[2].done and plain.error is None
        # the plain row's masks take microseconds: charged nothing, or on a busy machine a
        # step or two that happened to be slow, far from its budget
        assert bomb.grammar_s > 0.3 and plain.grammar_s < 0.1
    finally:
        grammars.close()


def test_an_empty_language_is_refused_and_a_dead_end_can_only_stop():
    """A constraint with no first token is a 400 before it runs; a row that reaches a dead
    end anyway may sample only its stop tokens (never an all -inf row, which cannot be
    sampled)."""
    import torch

    from engine.executor.grammar import _allow

    tokenizer = loaded("qwen2_5_vl").tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1)
    try:
        with pytest.raises(InvalidRequestError) as info:
            grammars.check(GrammarSpec("regex", "[^\\x00-\\U0010FFFF]", "guided_regex"))
        assert "no output" in info.value.message and info.value.param == "guided_regex"
    finally:
        grammars.close()
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    _allow(bitmask, 1, [0, 31, 33])
    bits = [(int(w) >> b) & 1 for w in bitmask[1] for b in range(32)]
    assert [i for i, bit in enumerate(bits) if bit] == [0, 31, 33]
    assert not bitmask[0].any()


def test_the_compile_queue_is_bounded_and_abandoned_compiles_never_run():
    """Distinct slow constraints cannot queue without bound: past MAX_QUEUED_COMPILES waiting
    for a thread, a new one is a 503 at once; a compile whose waiter gave up before a thread
    took it leaves the cache and is never compiled (it held a thread after its 503)."""
    import threading

    from engine.executor import grammar

    tokenizer = loaded("qwen2_5_vl").tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1)
    gate = threading.Event()
    try:
        grammars._pool.submit(gate.wait)  # the one compile thread is busy
        specs = [GrammarSpec("regex", f"a{{{k}}}", "guided_regex")
                 for k in range(grammar.MAX_QUEUED_COMPILES + 1)]
        futures = [grammars.compile(spec) for spec in specs[:-1]]
        with pytest.raises(OverloadedError) as info:
            grammars.compile(specs[-1])
        assert info.value.status == 503 and info.value.code == "grammar_compiler_busy"
        with pytest.raises(OverloadedError):
            grammars.check(specs[0], timeout_s=0.01)  # gave up while queued
        gate.set()
        with pytest.raises(OverloadedError):
            futures[0].result(timeout=30)  # never compiled
        assert futures[1].result(timeout=30) is not None
        assert grammars.stats["compiles"] == grammar.MAX_QUEUED_COMPILES
        assert grammars.compile(specs[-1]).result(timeout=30) is not None  # room again
    finally:
        gate.set()
        grammars.close()


# -- forced tool calls ---------------------------------------------------------------------

FORECAST = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Lima", "Pune"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                   "maximum": 23}}, "required": ["hour"]}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather.",
                                           "parameters": FORECAST}},
         {"type": "function", "function": {"name": "alarm", "parameters": ALARM}}]
SCHEMAS = {"forecast": FORECAST, "alarm": ALARM}
ASK = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]


def check_calls(calls, names=("forecast",)) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        assert valid(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_always_yields_a_valid_call(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, n=4, max_tokens=48, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "forecast"}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_required_yields_calls_of_the_declared_tools(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4, max_tokens=96,
        parallel_tool_calls=False)
    finished = [c for c in reply.choices if c.finish_reason == "tool_calls"]
    assert len(finished) >= 3 and all(c.finish_reason == "length" for c in reply.choices
                                       if c not in finished)
    for choice in finished:
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false
        check_calls(choice.message.tool_calls, names=("forecast", "alarm"))


def test_a_streamed_forced_call_arrives_whole_in_its_last_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48, stream=True,
        tool_choice={"type": "function", "function": {"name": "forecast"}})
    chunks = [c for c in stream if c.choices]
    assert len(chunks) == 1  # nothing before the call is whole
    choice = chunks[0].choices[0]
    assert choice.finish_reason == "stop" and choice.delta.role == "assistant"
    assert choice.delta.tool_calls[0].index == 0
    check_calls(choice.delta.tool_calls)


#: what a model answering in the hermes format writes (a regex makes the random model write it)
HERMES = (r'Sure\. <tool_call>\n\{"name": "forecast", "arguments": '
          r'\{"city": "(Oslo|Lima)", "days": [1-7]\}\}\n</tool_call>')


def test_auto_with_the_hermes_parser_turns_a_tool_call_text_into_tool_calls(client):
    """Served with --enable-auto-tool-choice --tool-call-parser hermes: the model's
    <tool_call> text becomes tool_calls (content: the text before it), whole or streamed;
    an answer in words stays content."""
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=96, extra_body={"guided_regex": HERMES})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    check_calls(choice.message.tool_calls)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            max_tokens=96, stream=True,
                                            extra_body={"guided_regex": HERMES})
    deltas = [c.choices[0] for c in stream if c.choices]
    content = "".join(d.delta.content or "" for d in deltas)
    assert content.startswith("Sure.") and "<tool" not in content
    assert deltas[-1].finish_reason == "tool_calls"
    check_calls(deltas[-1].delta.tool_calls)
    words = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=8, extra_body={"guided_regex": "[a-z]{3}"})
    assert words.choices[0].message.tool_calls is None
    assert re.fullmatch("[a-z]{3}", words.choices[0].message.content)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="none", max_tokens=2)
    assert plain.choices[0].message.tool_calls is None
    # "none" still shows the model its tools, as vLLM's template call does by default
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert plain.usage.prompt_tokens == words.usage.prompt_tokens > bare.usage.prompt_tokens


def test_the_tools_template_writes_tools_calls_and_results_as_qwen_does():
    """engine/models/templates/qwen2_5_vl_tools.jinja: Qwen2.5's hermes tool section on
    Qwen2.5-VL's media placeholders; without tools a chat renders as the model's own."""
    from engine.models.loader import load_model
    from engine.processing.chat_parts import parse_messages
    from engine.processing.prompt import render_chat

    model = load_model("tiny:qwen2_5_vl", chat_template=str(template_path("qwen2_5_vl_tools")))
    history = parse_messages([
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a"}},
                                     {"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {
            "name": "forecast", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]).messages
    text = render_chat(model, history, TOOLS[:1])
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ('<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Weather?<|im_end|>\n'
            '<|im_start|>assistant\n<tool_call>\n{"name": "forecast", "arguments": {"city": '
            '"Oslo"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "x"}]
    assert render_chat(model, chat) == render_chat(loaded("qwen2_5_vl"), chat)
