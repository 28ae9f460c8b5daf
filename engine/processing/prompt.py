"""Prompt rendering: chat messages through the chat template; raw prompts with the family's
placeholders, inserted for each media item the user did not write one for."""

from __future__ import annotations

from collections import Counter
from typing import Any

from engine.errors import ConfigError, InvalidRequestError
from engine.models.loader import LoadedModel
from engine.models.registry import ArchSpec


def render_chat(loaded: LoadedModel, messages: list[dict[str, Any]]) -> str:
    """The prompt text for HF-style messages (content parts ``{"type": "image"}`` etc.)."""
    if not loaded.chat_template:
        raise ConfigError(
            f"the model {loaded.name} has no chat template (its tokenizer ships none)",
            hint="pass --chat-template FILE, e.g. engine/models/templates/llava.jinja for "
                 "LLaVA-1.5", code="chat_template_missing")
    try:
        return loaded.processor.apply_chat_template(
            messages, chat_template=loaded.chat_template, tokenize=False,
            add_generation_prompt=True)
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
