"""A prompt's input embeddings with its media features in place, as the model's own forward
merges them: what lets a prefill resume inside a media span.

A warm prompt's cached prefix may end inside its media span: "<image> What is this?" leaves
fewer than a block of text after the image, so the last full cached block holds image tokens.
The model's forward cannot take part of an item (it places all of an item's encoder output at
its placeholder tokens, or refuses), so before this the prefix was cut back to the span's start
and the whole span prefilled again. Instead the prompt's embeddings are taken from the model's
own merge (its embedding table, its encoder, the encoder output cache when it holds the items,
its projector and placement), by running the outer model up to its language model and stopping
there; the prefill then feeds the model the embeddings after the cached prefix
(``inputs_embeds``), as vLLM feeds its model the slice of an item's encoder output that a step
needs (``_gather_mm_embeddings``).

The pre-hook on the language model is installed once and captures only for the thread inside
:meth:`MergedEmbeds.__call__`: with ``--overlap-prefill`` the engine thread runs decode steps
of the same model while a prefill runs on another.

Families whose media features also enter deeper layers (Qwen3-VL's deepstack) or that attend
both ways within an image (Gemma 3) do not resume inside a span (``ArchSpec.resume_in_media``).
"""

from __future__ import annotations

import threading
from typing import Any


class _Captured(Exception):
    """Raised by the language model's pre-hook: the embeddings it was called with."""

    def __init__(self, embeds: Any) -> None:
        super().__init__("input embeddings captured")
        self.embeds = embeds


class MergedEmbeds:
    """Takes a model's merged input embeddings (:meth:`__call__`). Its pre-hook on the
    language model is installed once and acts only on the thread that asked, inside the
    call: the engine's decode steps run the same model on another thread meanwhile
    (``--overlap-prefill``) and pass through it untouched."""

    def __init__(self, model: Any, text_model: Any) -> None:
        self.model = model
        self._local = threading.local()
        text_model.register_forward_pre_hook(self._grab, with_kwargs=True)

    def _grab(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if not getattr(self._local, "active", False):
            return
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError(f"{type(self.model).__name__} called its language model "
                               "without input embeddings")
        raise _Captured(embeds)

    def __call__(self, inputs: dict[str, Any], positions: Any) -> Any:
        """``(rows, tokens, hidden)``: the embeddings the model hands its language model for
        ``inputs`` (a whole prompt's ids, mask and media tensors) at ``positions``; no
        decoder layer runs."""
        self._local.active = True
        try:
            self.model(**inputs, position_ids=positions, use_cache=False, logits_to_keep=1)
        except _Captured as captured:
            return captured.embeds
        finally:
            self._local.active = False
        raise RuntimeError(f"{type(self.model).__name__} never called its language model")
