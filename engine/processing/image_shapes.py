"""Images of a size seen before: the image processor alone, the prompt expansion remembered.

Preprocessing an image item calls the model's whole HF processor on a one-placeholder text:
the image processor for the pixels, then the tokenizer and the processor's own argument
merging and token replacement for the expansion. That text side costs about a millisecond
(transformers validates every keyword argument of every modality on each call): half the
time of a 256x256 image for Qwen2-VL. But an image's expansion (how many tokens, and for
Gemma 3 and SmolVLM the text around them) depends on its size and the processor kwargs, never
on its pixels. So the expansion is remembered per (size, kwargs), and an image of a known size
runs only the image processor.

Safety: for each kwargs set, the first time an image could take this path, the whole
processor's tensors are compared with the image processor's alone; only if they are equal
(same keys, same values) is the path used for that kwargs set. A processor that routes a
kwarg elsewhere, or adds tensors of its own, keeps the full call.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: sizes x kwargs remembered (an expansion is a list of ids: small)
MAX_SHAPES = 1024


@dataclass(frozen=True)
class Expansion:
    ids: tuple[int, ...]
    count: int
    text: str | None


def kwargs_key(kwargs: dict[str, Any]) -> str:
    return json.dumps(kwargs, sort_keys=True, default=repr)


def size_key(data: Any) -> tuple | None:
    """What an image's expansion can depend on besides kwargs: its shape and type (a PIL
    image's size and mode); None for anything else."""
    shape = getattr(data, "shape", None)
    if shape is not None:
        return ("array", tuple(int(d) for d in shape), str(getattr(data, "dtype", "")))
    size, mode = getattr(data, "size", None), getattr(data, "mode", None)
    if isinstance(size, tuple) and isinstance(mode, str):
        return ("pil", size, mode)
    return None


class ShapeExpansions:
    """Remembered expansions, and per kwargs set whether the image processor alone gives what
    the whole processor gives (None: not yet known)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self._expansions: OrderedDict[tuple, Expansion] = OrderedDict()
        self._lock = threading.Lock()  # an API server preprocesses in a thread pool
        self._merged: dict[str, dict[str, Any]] = {}
        #: per kwargs set: the tensors the whole processor returns, when the image processor
        #: alone was proven to give them (it may give more: InternVL's num_patches, Gemma 3's
        #: num_crops, SmolVLM's rows and cols, which the processor uses for the text and
        #: drops); None when it was not
        self.proven: dict[str, frozenset[str] | None] = {}

    def image_kwargs(self, key: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What the whole processor hands its image processor for ``kwargs``: its own
        defaults merged with them as its ``__call__`` merges them (once per kwargs set)."""
        found = self._merged.get(key)
        if found is None:
            tokenizer = getattr(self.processor, "tokenizer", None)
            merged = self.processor._merge_kwargs(
                tokenizer_init_kwargs=tokenizer.init_kwargs if tokenizer is not None else {},
                return_tensors="pt", **kwargs)
            found = self._merged[key] = dict(merged["images_kwargs"])
        return found

    def lookup(self, size: tuple, kwargs: str) -> Expansion | None:
        with self._lock:
            found = self._expansions.get((size, kwargs))
            if found is not None:
                self._expansions.move_to_end((size, kwargs))
            return found

    def remember(self, size: tuple, kwargs: str, expansion: Expansion) -> None:
        with self._lock:
            self._expansions[(size, kwargs)] = expansion
            while len(self._expansions) > MAX_SHAPES:
                self._expansions.popitem(last=False)

    def run(self, data: Any, key: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The image processor alone on one image, as the whole processor would call it."""
        out = self.processor.image_processor([data], **self.image_kwargs(key, kwargs))
        return dict(out.items())

    def shortcut(self, size: tuple, key: str, data: Any, kwargs: dict[str, Any]
                 ) -> tuple[dict[str, Any], Expansion] | None:
        """An image of a size seen before, its kwargs set proven: the image processor alone's
        tensors and the remembered expansion; None when the whole processor must run."""
        remembered, names = self.lookup(size, key), self.proven.get(key)
        if remembered is None or not names:
            return None
        alone = self.run(data, key, kwargs)
        return {k: alone[k] for k in names}, remembered

    def learn(self, size: tuple, key: str, data: Any, kwargs: dict[str, Any],
              expansion: Expansion, whole: dict[str, Any]) -> None:
        """After the whole processor ran on an image: remember its expansion; on the second
        image of a size, prove (once per kwargs set) that the image processor alone gives the
        tensors the whole processor gave (``whole``)."""
        seen = self.lookup(size, key) is not None
        self.remember(size, key, expansion)
        if seen and key not in self.proven:
            try:
                alone = self.run(data, key, kwargs)
            except (ValueError, TypeError, RuntimeError, IndexError, AttributeError, KeyError):
                alone = None  # this processor's call cannot be reproduced: keep it
            self.proven[key] = proof(alone, whole)


def proof(alone: dict[str, Any] | None, whole: dict[str, Any]) -> frozenset[str] | None:
    """The whole processor's tensor names when the image processor alone gave each of them
    with equal values; else None."""
    import torch

    if alone is None or not whole.keys() <= alone.keys():
        return None
    for key, value in whole.items():
        other = alone[key]
        same = torch.equal(value, other) if isinstance(value, torch.Tensor) and isinstance(
            other, torch.Tensor) else value == other
        if not same:
            return None
    return frozenset(whole)
