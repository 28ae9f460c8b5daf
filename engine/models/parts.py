"""Where a Hugging Face model keeps its parts (the engine reads its language model)."""

from __future__ import annotations

from typing import Any


def language_model(model: Any) -> Any | None:
    """The module a multimodal model hands its merged input embeddings to (``language_model``;
    SmolVLM's ``text_model``), or None."""
    for owner in (model, getattr(model, "model", None)):
        for attr in ("language_model", "text_model"):
            found = getattr(owner, attr, None) if owner is not None else None
            if found is not None:
                return found
    return None
