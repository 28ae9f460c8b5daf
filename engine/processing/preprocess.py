"""Preprocessing with a per-item processor cache.

Each media item is processed on its own (the HF processor with a one-placeholder text), which
yields its tensors and the token ids its placeholder token expands to (the token repeated, or
for Qwen3-VL videos, timestamp text and vision markers around each frame's tokens); that is
what the cache holds. A prompt is then assembled: the prompt tokenized with its placeholders
unexpanded, each placeholder token replaced by its item's ids, and the items' tensors
concatenated in order. Tests check the assembly equals one processor call on
the whole prompt, so a cache hit gives the model exactly what a miss gives it.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError, MediaDecodeError, sanitize
from engine.models.loader import LoadedModel
from engine.processing.cache import ProcessorCache, content_hash, item_key
from engine.processing.prompt import count_placeholders

_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}
_ARG = {"image": "images", "video": "videos", "audio": "audio"}


@dataclass
class MediaItem:
    """One media item. ``encoded`` (fetched bytes) is hashed when given, else the decoded
    data; ``decode`` runs only on a cache miss."""

    modality: str
    encoded: bytes | None = None
    decoded: Any = None
    decode: Callable[[], Any] | None = None
    media_kwargs: dict[str, Any] = field(default_factory=dict)
    #: a video's Hugging Face ``video_metadata`` (fps, frames_indices...), set by its decode
    metadata: dict[str, Any] | None = None

    def hash_source(self) -> bytes | memoryview:
        if self.encoded is not None:
            return self.encoded
        data = self.decoded
        if isinstance(data, tuple):  # (waveform, sampling rate)
            data = data[0]
        return memoryview(data.tobytes()) if hasattr(data, "tobytes") else repr(data).encode()


@dataclass
class ProcessedItem:
    tensors: dict[str, Any]
    num_tokens: int
    nbytes: int
    #: the ids that replace the placeholder's expansion token in the prompt
    expansion: list[int]


@dataclass
class ProcessedPrompt:
    """What the executor needs for one prompt, and how it was obtained."""

    input_ids: list[int]
    mm: dict[str, Any]
    item_hits: list[bool]
    timings: dict[str, float]
    modality_counts: dict[str, int]


class Preprocessor:
    """Turns a prompt and its media items into model inputs, through the cache."""

    def __init__(self, loaded: LoadedModel, cache: ProcessorCache | None = None) -> None:
        self.loaded = loaded
        self.cache = cache or ProcessorCache(0)
        tok = loaded.tokenizer
        self.expansion_ids = {m: tok.convert_tokens_to_ids(t)
                              for m, t in loaded.spec.expansion_tokens.items()}
        self._id_modality = {i: m for m, i in self.expansion_ids.items()}
        self._prompt_ids: dict[str, list[int]] = {}
        # Qwen-VL processors also return mm_token_type_ids (1 image token, 2 video token).
        self.type_ids = {self.expansion_ids[m]: v for m, v in loaded.spec.token_types.items()
                         if m in self.expansion_ids}

    def _tokenize(self, prompt: str) -> list[int]:
        """Token ids of a prompt with unexpanded placeholders; prompts repeat (templates), so
        the last few hundred are remembered."""
        ids = self._prompt_ids.get(prompt)
        if ids is None:
            ids = list(self.loaded.tokenizer(prompt)["input_ids"])
            if len(self._prompt_ids) >= 512:
                self._prompt_ids.pop(next(iter(self._prompt_ids)))
            self._prompt_ids[prompt] = ids
        return ids

    def process_item(self, item: MediaItem, data: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        """The HF processor on one item (a one-placeholder text)."""
        spec = self.loaded.spec
        extra = dict(kwargs)
        if item.modality == "audio":
            data, rate = data
            extra.setdefault("sampling_rate", rate)
        if item.modality == "video" and spec.video_timestamps:
            extra["do_sample_frames"] = False  # the engine sampled them; metadata says which
            if item.metadata is not None:
                # a copy: the processor extends an odd frames_indices list in place
                extra["video_metadata"] = [copy.deepcopy(item.metadata)]
        try:
            out = self.loaded.processor(text=[spec.placeholders[item.modality]],
                                        **{_ARG[item.modality]: [data]}, return_tensors="pt",
                                        **extra)
        except (ValueError, TypeError, RuntimeError, IndexError) as exc:
            raise MediaDecodeError(f"the {item.modality} could not be processed for this model:"
                                   f" {sanitize(exc)}", code="processor_failed") from None
        ids = out["input_ids"][0].tolist()
        expansion = self._expansion(item.modality, ids)
        count = expansion.count(self.expansion_ids[item.modality])
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        nbytes = sum(int(v.numel() * v.element_size()) for v in tensors.values()
                     if hasattr(v, "numel")) + 8 * len(expansion)
        return ProcessedItem(tensors, count, nbytes, expansion)

    def _expansion(self, modality: str, ids: list[int]) -> list[int]:
        """What the processor put in place of the placeholder's expansion token: the ids of
        one processed placeholder less the unexpanded placeholder's ids around that token."""
        placeholder = self._tokenize(self.loaded.spec.placeholders[modality])
        at = placeholder.index(self.expansion_ids[modality])
        before, after = placeholder[:at], placeholder[at + 1:]
        end = len(ids) - len(after)
        if ids[:at] != before or ids[end:] != after or end < at:
            raise RuntimeError(f"the {modality} processor changed the text around its "
                               "placeholder; per-item assembly cannot reproduce it")
        return ids[at:end]

    def process(self, prompt: str, items: list[MediaItem], kwargs: dict[str, Any] | None = None,
                ) -> ProcessedPrompt:
        """Cache lookup (and, on a miss, decode + process) per item, then assembly."""
        kwargs = kwargs or {}
        timings = {"hash_s": 0.0, "cache_lookup_s": 0.0, "media_decode_s": 0.0, "processor_s": 0.0}
        placeholders = count_placeholders(prompt, self.loaded.spec)
        counts = Counter(i.modality for i in items)
        for modality in set(placeholders) | set(counts):
            if placeholders.get(modality, 0) != counts.get(modality, 0):
                raise InvalidRequestError(
                    f"the prompt has {placeholders.get(modality, 0)} {modality} placeholder(s) "
                    f"for {counts.get(modality, 0)} {modality} item(s)",
                    code="placeholder_mismatch", param="prompt")
        processed: list[ProcessedItem] = []
        hits: list[bool] = []
        for item in items:
            start = time.perf_counter()
            key = None
            if self.cache.enabled:
                key = item_key(self.loaded.name, item.modality, content_hash(item.hash_source()),
                               kwargs, item.media_kwargs)
            mid = time.perf_counter()
            timings["hash_s"] += mid - start
            cached = self.cache.get(key) if key is not None else None
            timings["cache_lookup_s"] += time.perf_counter() - mid
            if cached is not None:
                processed.append(cached)
                hits.append(True)
                continue
            start = time.perf_counter()
            data = item.decoded if item.decoded is not None else item.decode()  # type: ignore[misc]
            timings["media_decode_s"] += time.perf_counter() - start
            start = time.perf_counter()
            result = self.process_item(item, data, kwargs)
            timings["processor_s"] += time.perf_counter() - start
            if key is not None:
                self.cache.put(key, result, result.nbytes)
            processed.append(result)
            hits.append(False)
        start = time.perf_counter()
        input_ids, mm = self.assemble(prompt, items, processed)
        timings["processor_s"] += time.perf_counter() - start
        return ProcessedPrompt(input_ids, mm, hits, timings, dict(counts))

    def assemble(self, prompt: str, items: list[MediaItem], processed: list[ProcessedItem]
                 ) -> tuple[list[int], dict[str, Any]]:
        import torch

        queues: dict[str, list[ProcessedItem]] = {}
        for item, result in zip(items, processed, strict=True):
            queues.setdefault(item.modality, []).append(result)
        order = {m: iter(q) for m, q in queues.items()}
        # Tokenize once with the placeholders unexpanded, then put each item's expansion in
        # place of its placeholder token: that token is an added special token (so are the
        # markers around any text an expansion holds), so this equals tokenizing the expanded
        # text (what the HF processor does) at a fraction of the cost.
        input_ids: list[int] = []
        for token in self._tokenize(prompt):
            modality = self._id_modality.get(token)
            input_ids.extend(next(order[modality]).expansion if modality else [token])
        mm: dict[str, Any] = {}
        for modality in ("image", "video", "audio"):
            for result in queues.get(modality, []):
                for key, value in result.tensors.items():
                    mm.setdefault(key, []).append(value)
        # One item: its cached tensors as they are (the model never writes into its inputs).
        merged = {k: v[0] if len(v) == 1 else torch.cat(v, dim=0) if hasattr(v[0], "dim")
                  else v for k, v in mm.items()}
        if self.type_ids:
            ids = torch.tensor([input_ids], dtype=torch.long)
            types = torch.zeros_like(ids)
            for token, value in self.type_ids.items():
                types[ids == token] = value
            merged["mm_token_type_ids"] = types
        return input_ids, merged
