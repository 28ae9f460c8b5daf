"""No request field silently ignored: every field of vLLM's and OpenAI's chat/completions
request lists (tests/request_fields.json, with their source and version) is honoured, a label,
or a 400 naming it (engine/server/api/request_fields.py), walked model-free and against a live
server; unknown fields are ignored and logged once per name. And ``--generation-config``:
the model's sampling defaults for what a request leaves out (vLLM's flag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ConfigError, InvalidRequestError
from engine.models.generation_config import sampling_defaults
from engine.server.api import request_fields
from engine.server.api.protocol import parse_generation_fields
from engine.server.launcher import checked_defaults

pytestmark = pytest.mark.timeout(300)
LISTS = json.loads((Path(__file__).resolve().parents[1] / "request_fields.json").read_text())
README = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
CHAT = sorted({*LISTS["vllm_chat"], *LISTS["openai_chat"], *LISTS["vllm_older"]})
COMPLETIONS = sorted({*LISTS["vllm_completions"], *LISTS["openai_completions"],
                      *LISTS["vllm_older"]})
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
#: a plausible value per field: one a client would send to use it (so a field the server
#: does not implement must be refused)
VALUES = {
    "model": "tiny-qwen2_5_vl", "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi", "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ["\n\n"], "n": 2,
    "stream": False, "stream_options": {"include_usage": True}, "ignore_eos": True,
    "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.1, "logit_bias": {"5": 1}, "min_tokens": 1,
    "stop_token_ids": [2], "bad_words": ["xyz"], "skip_special_tokens": False,
    "include_stop_str_in_output": True, "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["a", "b"]}, "guided_json": {"type": "object"},
    "guided_regex": "[ab]", "guided_choice": ["a", "b"], "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": None,
    "priority": 0, "cache_salt": "tenant-1", "return_tokens_as_token_ids": True,
    "mm_processor_kwargs": {}, "media_io_kwargs": {}, "tools": [TOOL],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "parallel_tool_calls": False, "user": "u-1", "metadata": {"k": "v"},
    "safety_identifier": "s-1", "prompt_cache_key": "k-1",
    # not implemented: each a value that asks for something
    "functions": [{"name": "f"}], "function_call": "auto", "best_of": 2, "echo": True,
    "suffix": "x", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "store": True, "service_tier": "flex",
    "moderation": {"model": "m"}, "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"}, "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 5,
    "prompt_logprobs": 1, "allowed_token_ids": [1, 2], "logits_processors": ["m.P"],
    "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1}, "request_id": "r-1", "prompt_embeds": "AAAA",
    "max_repetition_pattern_size": 4, "min_repetition_pattern_size": 2,
    "repetition_min_count": 3, "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "include_reasoning": False,
}


def kind(name: str, chat: bool) -> str:
    honoured = request_fields.HONOURED_CHAT if chat else request_fields.HONOURED_COMPLETIONS
    refused = {**request_fields.REFUSED, **(request_fields.REFUSED_CHAT if chat
                                            else request_fields.REFUSED_COMPLETIONS)}
    kinds = [k for k, names in (("honoured", honoured), ("label", request_fields.LABELS),
                                ("refused", refused)) if name in names]
    assert len(kinds) == 1, (name, kinds)
    return kinds[0]


def walk(chat: bool) -> list[tuple[str, str]]:
    return [(name, kind(name, chat)) for name in (CHAT if chat else COMPLETIONS)]


def base(chat: bool) -> dict:
    return {"model": "tiny-qwen2_5_vl", "max_tokens": 3,
            **({"messages": VALUES["messages"]} if chat else {"prompt": "hi"})}


def with_field(name: str, chat: bool) -> dict:
    # add_special_tokens: chat's default is false, completions' true; the other asks
    body = {**base(chat), name: VALUES[name] if name != "add_special_tokens" else chat}
    if name == "top_logprobs":
        body["logprobs"] = True
    if name == "logprobs" and not chat:
        body["logprobs"] = 2
    if name in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = [TOOL]
    if name == "stream_options":
        body["stream"] = True
    return body


@pytest.mark.parametrize("chat", [True, False])
def test_every_listed_field_is_honoured_a_label_or_refused_by_name(chat):
    """Model-free: each field of both lists has one kind, and its plausible value parses
    (honoured, label) or is a 400 naming it (refused)."""
    for name, what in walk(chat):
        if name in ("messages", "prompt", "model"):
            continue  # (read by the routes, not the generation fields)
        body = with_field(name, chat)
        if what == "refused":
            with pytest.raises(InvalidRequestError) as err:
                parse_generation_fields(body, max_tokens_cap=4096, chat=chat, vocab_size=449,
                                        tool_parser="hermes")
            assert err.value.param == name and err.value.status == 400, name
        else:
            parse_generation_fields(body, max_tokens_cap=4096, chat=chat, vocab_size=449,
                                    tool_parser="hermes")


def test_the_readme_names_every_field():
    text = README.read_text()
    missing = [n for n in sorted({*CHAT, *COMPLETIONS}) if f"`{n}`" not in text]
    assert not missing


def test_unknown_fields_are_logged_once_per_name(caplog):
    body = {**base(True), "frobnicate_once": 1, "x" * 500: 2}
    with caplog.at_level("WARNING", logger="aphrodite.server"):
        first = request_fields.note_unknown(body, chat=True)
        again = request_fields.note_unknown(body, chat=True)
    assert first == ["frobnicate_once", "x" * 64] and again == []
    assert sum("frobnicate_once" in r.getMessage() for r in caplog.records) == 1


def write_config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_generation_config_modes(tmp_path):
    model = write_config(tmp_path / "model", {"temperature": 0.3, "top_k": 20,
                                              "max_new_tokens": 5, "eos_token_id": 2})
    assert sampling_defaults("auto", model) == {"temperature": 0.3, "top_k": 20,
                                                "max_tokens": 5}
    assert sampling_defaults("vllm", model) == {}
    assert sampling_defaults("auto", tmp_path) == {}  # no file: no defaults
    other = write_config(tmp_path / "other", {"repetition_penalty": 1.2, "min_p": 0.05})
    assert sampling_defaults(str(other), model) == {"repetition_penalty": 1.2, "min_p": 0.05}
    for bad in (str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(ConfigError, match="--generation-config"):
            sampling_defaults(bad, model)
    write_config(tmp_path / "hot", {"temperature": 9})
    with pytest.raises(ConfigError, match="temperature=9 must be between 0 and 2"):
        checked_defaults(str(tmp_path / "hot"), str(model))


def test_generation_defaults_apply_only_where_the_request_leaves_them_out():
    defaults = {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 5}
    left_out = parse_generation_fields(base(True) | {"max_tokens": None},
                                       max_tokens_cap=4096, defaults=defaults)
    sp = left_out.sampling_for(10, 8192, "messages")
    assert (sp.temperature, sp.repetition_penalty, sp.max_tokens) == (0.0, 1.3, 5)
    own = parse_generation_fields(base(True) | {"temperature": 0.7, "max_tokens": 9},
                                  max_tokens_cap=4096, defaults=defaults)
    sp = own.sampling_for(10, 8192, "messages")
    assert (sp.temperature, sp.repetition_penalty, sp.max_tokens) == (0.7, 1.3, 9)


def served_generation_config(folder: Path) -> None:
    write_config(folder, {"temperature": 0, "max_new_tokens": 4, "eos_token_id": 2})


SERVED = pytest.mark.serve("--generation-config", "{scratch}", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", prepare=served_generation_config)


@pytest.fixture
def server(served):
    """The server of the tests marked ``SERVED`` (tests/served.py)."""
    return served


def post(server, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.base}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if not body.get("stream") else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@SERVED
def test_served_field_walk_and_unknown_fields_logged_once(server):
    """Each field of both lists, alone with its plausible value, on both endpoints: a 200
    (honoured or a label) or a 400 naming it (refused); never a 500."""
    for chat in (True, False):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        for name, what in walk(chat):
            status, answer = post(server, path, with_field(name, chat))
            if what == "refused":
                assert (status, answer["error"]["param"]) == (400, name), (path, name)
            else:
                assert status == 200, (path, name, answer)
    for _ in range(2):
        assert post(server, "/v1/completions", {**base(False), "frobnicate": 1})[0] == 200
    assert server.output.count("unknown request field 'frobnicate'") == 1


@SERVED
def test_served_generation_config_defaults(server):
    """The folder's temperature 0 and max_new_tokens 4 apply where a request leaves them
    out (logged at start-up); a request's own values win."""
    assert "Default sampling parameters from" in server.output
    assert "'temperature': 0" in server.output
    body = {"model": "tiny-qwen2_5_vl", "prompt": "Once upon", "ignore_eos": True}
    texts = {post(server, "/v1/completions", {**body, "seed": s})[1]["choices"][0]["text"]
             for s in (1, 2, 3)}
    assert len(texts) == 1  # greedy whatever the seed
    assert post(server, "/v1/completions", body)[1]["usage"]["completion_tokens"] == 4
    own = post(server, "/v1/completions", {**body, "max_tokens": 6, "temperature": 1.0,
                                           "seed": 1})[1]
    assert own["usage"]["completion_tokens"] == 6
