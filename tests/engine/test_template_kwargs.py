"""vLLM's ``chat_template_kwargs`` (engine/processing/template_kwargs.py): the bounds on a
request's template variables (model-free), and what they do to the rendered prompt with the
tiny models' real processors and templates (Qwen-VL's own ``add_vision_id``, and a template
that writes a variable); the offline ``LLM.chat`` takes them under the same rules."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from engine.errors import InvalidRequestError
from engine.processing.prompt import render_chat
from engine.processing.template_kwargs import (
    MAX_BYTES,
    MAX_KEYS,
    RESERVED,
    parse_template_kwargs,
    template_variables,
)
from engine.server.api.protocol import parse_generation_fields
from tests.engine_fixtures import llm, loaded
from tests.fixtures import synthetic

pytestmark = pytest.mark.timeout(300)
IMAGE_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
GREETING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ greeting | default('') }}"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_values_a_client_sends_are_taken_as_they_are():
    kwargs = {"enable_thinking": False, "add_vision_id": True, "date_string": "1 Jan",
              "n": 3, "x": 1.5, "none": None, "tags": ["a", {"b": [1, 2]}]}
    assert parse_template_kwargs(kwargs) == kwargs
    assert parse_template_kwargs(None) is None and parse_template_kwargs({}) is None


@pytest.mark.parametrize(("value", "code", "words"), [
    ("enable_thinking", "invalid_chat_template_kwargs", "must be an object"),
    ([["a", 1]], "invalid_chat_template_kwargs", "must be an object"),
    ({"1st": 1}, "invalid_chat_template_kwargs", "not a template variable name"),
    ({"a-b": 1}, "invalid_chat_template_kwargs", "not a template variable name"),
    ({"x" * 65: 1}, "invalid_chat_template_kwargs", "not a template variable name"),
    ({"messages": []}, "reserved_template_variable", "'messages' is set by the server"),
    ({"tools": []}, "reserved_template_variable", "'tools' is set by the server"),
    ({"add_generation_prompt": False}, "reserved_template_variable", "add_generation_prompt"),
    ({"chat_template": "{{ 1 }}"}, "reserved_template_variable", "--chat-template"),
    ({"tokenize": True}, "reserved_template_variable", "'tokenize'"),
    ({"bos_token": "<|im_start|>"}, "reserved_template_variable", "'bos_token'"),
    ({"raise_exception": 1}, "reserved_template_variable", "'raise_exception'"),
    ({f"k{i}": 1 for i in range(MAX_KEYS + 1)}, "invalid_chat_template_kwargs",
     f"over the limit of {MAX_KEYS}"),
    ({"big": "x" * MAX_BYTES}, "invalid_chat_template_kwargs", f"over the limit of {MAX_BYTES}"),
    ({"deep": [[[[[1]]]]]}, "invalid_chat_template_kwargs", "nests deeper"),
    ({"nan": float("nan")}, "invalid_chat_template_kwargs", "not a finite number"),
])
def test_bad_template_variables_are_a_400_naming_the_field(value, code, words):
    with pytest.raises(InvalidRequestError) as err:
        parse_generation_fields({"max_tokens": 2, "chat_template_kwargs": value},
                                max_tokens_cap=16, chat=True)
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"
    assert err.value.code == code and words in str(err.value), str(err.value)


def test_the_reserved_names_cover_what_the_server_passes_the_template():
    assert {"messages", "tools", "add_generation_prompt", "documents",
            "continue_final_message"} <= RESERVED


def test_completions_refuse_them_unless_empty():
    assert parse_generation_fields({"chat_template_kwargs": {}}, max_tokens_cap=16,
                                   chat=False).chat_template_kwargs is None
    with pytest.raises(InvalidRequestError) as err:
        parse_generation_fields({"chat_template_kwargs": {"enable_thinking": False}},
                                max_tokens_cap=16, chat=False)
    assert err.value.param == "chat_template_kwargs" and err.value.code == \
        "unsupported_parameter"


def test_qwen_vl_add_vision_id_numbers_the_pictures():
    model = loaded("qwen2_5_vl")
    assert "add_vision_id" in template_variables(model.chat_template)
    plain = render_chat(model, IMAGE_CHAT)
    numbered = render_chat(model, IMAGE_CHAT, None, {"add_vision_id": True})
    assert "Picture 1: " not in plain and "Picture 1: <|vision_start|>" in numbered
    assert numbered.replace("Picture 1: ", "") == plain


def test_a_variable_the_template_writes_changes_the_prompt_and_control_tokens_are_refused():
    model = dataclasses.replace(loaded("qwen2_5_vl"), chat_template=GREETING)
    chat = [{"role": "user", "content": "hi"}]
    assert "user\nBonjour! hi" in render_chat(model, chat, None, {"greeting": "Bonjour! "})
    assert "user\nhi" in render_chat(model, chat)
    with pytest.raises(InvalidRequestError) as err:
        render_chat(model, chat, None, {"greeting": ["ok", {"x": "<|im_end|>"}]})
    assert err.value.param == "chat_template_kwargs"
    assert err.value.code == "control_token_in_text" and "<|im_end|>" in str(err.value)


def test_a_name_the_template_does_not_read_is_left_out_and_logged_once(caplog):
    model = loaded("qwen2_5_vl")
    plain = render_chat(model, IMAGE_CHAT)
    with caplog.at_level(logging.WARNING, logger="aphrodite.server"):
        for _ in range(3):  # (Hugging Face would take it for a processor argument)
            assert render_chat(model, IMAGE_CHAT, None, {"enable_thinking_xyz": False}) == plain
    logged = [r for r in caplog.records if "enable_thinking_xyz" in r.getMessage()]
    assert len(logged) == 1 and "does not read" in logged[0].getMessage()


def test_the_offline_chat_takes_them():
    import base64

    from engine import SamplingParams

    model = llm("qwen2_5_vl")
    url = "data:image/png;base64," + base64.b64encode(
        synthetic.make_image(64, 48, fmt="PNG", seed=4)).decode()
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "hi"}]}]
    params = SamplingParams(max_tokens=1, temperature=0)
    base = model.chat(chat, params)[0].prompt_token_ids
    numbered = model.chat(chat, params, chat_template_kwargs={"add_vision_id": True})[0]
    tokenizer = loaded("qwen2_5_vl").tokenizer
    assert len(numbered.prompt_token_ids) == len(base) + len(
        tokenizer("Picture 1: ", add_special_tokens=False)["input_ids"])
    with pytest.raises(InvalidRequestError, match="'messages' is set by the server"):
        model.chat(chat, params, chat_template_kwargs={"messages": []})
