"""Loaded tiny models, shared by the engine tests (built once into the user cache)."""

from __future__ import annotations

import functools

from engine.models import decode_kernels
from engine.models.loader import LoadedModel, load_model
from engine.models.templates_path import template_path

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "llava", "qwen2_audio", "llava_onevision",
            "internvl", "gemma3", "smolvlm")
#: the kernels' minimum weight as the engine has it (before any test patches it)
_MIN_LINEAR_WEIGHT = decode_kernels.MIN_LINEAR_WEIGHT


@functools.cache
def loaded(arch: str) -> LoadedModel:
    template = str(template_path("llava")) if arch == "llava" else None
    return load_model(f"tiny:{arch}", chat_template=template)


@functools.cache
def llm(arch: str):
    """The shared LLM of ``arch`` (cached: every later test gets this one). Refused while a
    test has patched the kernels' minimum weight: built then, its decode step would run the
    kernels for every later test (load it before patching)."""
    from engine import LLM

    assert decode_kernels.MIN_LINEAR_WEIGHT == _MIN_LINEAR_WEIGHT, \
        "the shared tiny LLM would be built under a patched MIN_LINEAR_WEIGHT"

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
