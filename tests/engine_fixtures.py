"""Loaded tiny models, shared by the engine tests (built once into the user cache)."""

from __future__ import annotations

import functools

from engine.models.loader import LoadedModel, load_model
from engine.models.templates_path import template_path

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "llava", "qwen2_audio")


@functools.cache
def loaded(arch: str) -> LoadedModel:
    template = str(template_path("llava")) if arch == "llava" else None
    return load_model(f"tiny:{arch}", chat_template=template)


@functools.cache
def llm(arch: str):
    from engine import LLM

    template = str(template_path("llava")) if arch == "llava" else None
    return LLM(f"tiny:{arch}", chat_template=template)
