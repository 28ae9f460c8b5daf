"""Loaded tiny models, shared by the engine tests (built once into the user cache)."""

from __future__ import annotations

import functools

from engine.models.loader import LoadedModel, load_model
from engine.models.templates_path import template_path

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "llava", "qwen2_audio", "llava_onevision",
            "internvl", "gemma3", "smolvlm")


@functools.cache
def loaded(arch: str) -> LoadedModel:
    template = str(template_path("llava")) if arch == "llava" else None
    return load_model(f"tiny:{arch}", chat_template=template)


@functools.cache
def llm(arch: str):
    from engine import LLM

    template = str(template_path("llava")) if arch == "llava" else None
    return LLM(f"tiny:{arch}", chat_template=template)


def hf_prompt_ids(arch: str, messages: list[dict], images: list | None = None) -> list[int]:
    """The prompt token ids of one call of the model's own Hugging Face processor on the
    whole chat (its own template; media parts written ``{"type": "image"}``): an oracle for
    what a server must send the model, computed without the engine's preprocessing."""
    processor = loaded(arch).processor
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=images or None, return_tensors="np")
    return [int(i) for i in out["input_ids"][0]]
