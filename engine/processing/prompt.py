"""Prompt rendering: chat messages through the chat template; raw prompts with the family's
placeholders, inserted for each media item the user did not write one for."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from engine.errors import ConfigError, InvalidRequestError
from engine.models.loader import LoadedModel
from engine.models.registry import ArchSpec
from engine.processing.template_kwargs import for_template, kwargs_strings

_CONTROL: dict[int, re.Pattern[str] | None] = {}


def control_tokens(loaded: LoadedModel) -> re.Pattern[str] | None:
    """The tokenizer's special tokens (``<|im_start|>``, ``<|image_pad|>``...) as one pattern."""
    key = id(loaded.processor)
    if key not in _CONTROL:
        tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        tokens = {t.content for t in added.values() if getattr(t, "special", False)}
        tokens |= set(getattr(tokenizer, "all_special_tokens", []) or [])
        tokens = {t for t in tokens if t}
        _CONTROL[key] = (re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len,
                                                                           reverse=True)))
                         if tokens else None)
    return _CONTROL[key]


def check_message_text(loaded: LoadedModel, messages: list[dict[str, Any]]) -> None:
    """Refuse message text that holds a control token: the template would read it as a role
    boundary or a media placeholder (prompt injection across roles), not as text."""
    pattern = control_tokens(loaded)
    if pattern is None:
        return
    for n, message in enumerate(messages):
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [
            p.get("text", "") for p in content or [] if p.get("type") == "text"]
        texts += [json.dumps(message[k], ensure_ascii=False) for k in ("tool_calls",
                                                                      "tool_call_id")
                  if k in message]  # (the template writes them too)
        for text in texts:
            found = pattern.search(text)
            if found:
                raise InvalidRequestError(
                    f"messages[{n}] contains the control token {found.group(0)!r} of this "
                    "model's chat template in its text",
                    hint="remove it: send media as content parts and let the template add "
                         "roles (raw prompts with tokens go to /v1/completions)",
                    code="control_token_in_text", param="messages")


def render_chat(loaded: LoadedModel, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for HF-style messages (content parts ``{"type": "image"}`` etc.), the
    request's ``tools`` (for a template that writes them) and its checked
    ``chat_template_kwargs`` (:mod:`engine.processing.template_kwargs`: the names the
    template reads); message text, tools or template variables holding a control token are
    refused (:func:`check_message_text`)."""
    check_message_text(loaded, messages)
    pattern = control_tokens(loaded)
    found = pattern.search(json.dumps(tools, ensure_ascii=False)) if pattern and tools else None
    if found:
        raise InvalidRequestError(f"tools contain the control token {found.group(0)!r} of this "
                                  "model's chat template", code="control_token_in_text",
                                  param="tools", hint="remove it")
    for text in kwargs_strings(template_kwargs) if pattern else ():
        found = pattern.search(text)
        if found:
            raise InvalidRequestError(
                f"chat_template_kwargs contain the control token {found.group(0)!r} of this "
                "model's chat template", code="control_token_in_text",
                param="chat_template_kwargs", hint="remove it")
    if not loaded.chat_template:
        raise ConfigError(
            f"the model {loaded.name} has no chat template (its tokenizer ships none)",
            hint="pass --chat-template FILE, e.g. engine/models/templates/llava.jinja for "
                 "LLaVA-1.5", code="chat_template_missing")
    try:
        return loaded.processor.apply_chat_template(
            messages, chat_template=loaded.chat_template, tokenize=False,
            add_generation_prompt=True, **({"tools": tools} if tools else {}),
            **for_template(loaded.chat_template, template_kwargs))
    except Exception as exc:  # jinja errors: a template that does not fit the messages
        raise InvalidRequestError(f"the chat template could not render these messages: "
                                  f"{str(exc).splitlines()[0][:160]}",
                                  code="chat_template_error", param="messages") from None


def count_placeholders(prompt: str, spec: ArchSpec) -> Counter[str]:
    return Counter({m: prompt.count(tok) for m, tok in spec.expansion_tokens.items()})


def insert_placeholders(prompt: str, spec: ArchSpec, counts: Counter[str] | dict[str, int]
                        ) -> str:
    """Prepend the family's placeholder for each item the prompt has none for; refuse more
    placeholders than items (they would be expanded against nothing)."""
    present = count_placeholders(prompt, spec)
    missing: list[str] = []
    for modality, count in counts.items():
        have = present.get(modality, 0)
        if have > count:
            raise InvalidRequestError(
                f"the prompt has {have} {modality} placeholder(s) but {count} {modality} "
                "item(s)", hint="send one item per placeholder or remove the extra ones",
                code="placeholder_mismatch", param="prompt")
        missing += [spec.placeholders[modality]] * (count - have)
    for modality, have in present.items():
        if have and modality not in counts:
            raise InvalidRequestError(
                f"the prompt has {have} {modality} placeholder(s) but no {modality} item",
                hint="send the media or remove the placeholder", code="placeholder_mismatch",
                param="prompt")
    if not missing:
        return prompt
    return "".join(f"{p}\n" for p in missing) + prompt
