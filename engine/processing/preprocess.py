"""Preprocessing with a per-item processor cache.

Each media item is processed on its own (the HF processor with a one-placeholder text), which
yields its tensors and the token ids its placeholder token expands to (the token repeated, or
for Qwen3-VL videos, timestamp text and vision markers around each frame's tokens); that is
what the cache holds. A prompt is then assembled: the prompt tokenized with its placeholders
unexpanded, each placeholder token replaced by its item's ids, and the items' tensors
concatenated in order. Families whose expansions hold text that meets the prompt's own (Gemma
3's blank lines around an image) cache the replacement text too, and their prompts are assembled
as text and tokenized once. Tests check the assembly equals one processor call on the whole
prompt, so a cache hit gives the model exactly what a miss gives it.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ClientError, InvalidRequestError, MediaDecodeError, sanitize
from engine.media.decode_errors import name_item
from engine.models.loader import LoadedModel
from engine.processing.cache import ProcessorCache, content_hash, item_key, salted_key
from engine.processing.image_layout import channels_first_view, is_rgb_pil, keep_channels_last
from engine.processing.image_shapes import (
    Expansion,
    ShapeExpansions,
    kwargs_key,
    size_key,
)
from engine.processing.limits import check_one_visual_modality
from engine.processing.prompt import count_placeholders
from engine.timings import zero_preprocess_timings

_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids",
              "text_replacement_offsets"}
_ARG = {"image": "images", "video": "videos", "audio": "audio"}


@dataclass
class MediaItem:
    """One media item. ``encoded`` (fetched bytes) is hashed when given, else the decoded
    data; ``decode`` runs only on a cache miss."""

    modality: str
    encoded: bytes | None = None
    decoded: Any = None
    decode: Callable[[], Any] | None = None
    #: an image's decode as an ``(H, W, 3)`` uint8 RGB array, for a consumer that takes arrays
    #: (``--engine vllm``'s bridge): no PIL image made and converted back
    decode_pixels: Callable[[], Any] | None = None
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
    #: the text the processor put there (kept for ``ArchSpec.assemble_text`` families)
    text: str | None = None


@dataclass
class ProcessedPrompt:
    """What the executor needs for one prompt, and how it was obtained."""

    input_ids: list[int]
    mm: dict[str, Any]
    item_hits: list[bool]
    timings: dict[str, float]
    modality_counts: dict[str, int]
    #: each item's content key (bytes + settings, as the processor cache names it) and the
    #: [offset, offset + length) range of its feature tokens in ``input_ids``, in prompt
    #: order (vLLM's ``mm_hashes``/``mm_positions``): prefix caching mixes the keys into the
    #: hashes of the blocks those tokens fall in
    mm_hashes: list[str] = field(default_factory=list)
    mm_positions: list[tuple[int, int]] = field(default_factory=list)
    #: for an engine that runs its own processor (``--engine vllm``): the prompt text with
    #: one placeholder per item (``input_ids`` then only its text tokens, ``mm`` the decoded
    #: items) and the request's processor kwargs
    text: str | None = None
    processor_kwargs: dict[str, Any] | None = None
    #: ``--engine vllm`` (see :mod:`engine.server.vllm_adapter.vllm_media`): ``item_hits`` marks
    #: the items
    #: left out because vLLM holds them; ``refill`` decodes every item again (``(mm,
    #: mm_sent)``), for when it does not; ``mm_sent`` the content keys and estimated
    #: processed bytes of the items sent with data
    refill: Callable[[], tuple[dict[str, Any], list[tuple[str, int]]]] | None = None
    mm_sent: list[tuple[str, int]] = field(default_factory=list)
    #: vLLM's ``cache_salt``: mixed into the item keys (processor and encoder caches) and
    #: the prefix-cache block hashes, so prompts of different salts share no cached work
    cache_salt: str | None = None


@contextlib.contextmanager
def _processor_errors(modality: str):
    """A processor's refusal of an item (an image too small to patch...) as a 422."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise MediaDecodeError(f"the {modality} could not be processed for this model: "
                               f"{sanitize(exc)}", code="processor_failed") from None


def _item(tensors: dict[str, Any], expansion: list[int], count: int, text: str | None
          ) -> ProcessedItem:
    nbytes = sum(int(v.numel() * v.element_size()) for v in tensors.values()
                 if hasattr(v, "numel")) + 8 * len(expansion) + len((text or "").encode())
    return ProcessedItem(tensors, count, nbytes, expansion, text)


def concat(values: list[Any], padded: bool = False) -> Any:
    """Items' tensors concatenated on the first dimension. ``padded`` (an ArchSpec
    ``padded_keys`` key: LLaVA-OneVision's tiles per image): items whose second dimension
    differs are zero-padded at its end to the longest first, as the HF processor pads a batch."""
    import torch

    if len(values) == 1:  # (a copy of a 16-frame video's patches costs a prefill 8 ms)
        return values[0]
    if padded and len({v.shape[1] for v in values}) > 1:
        width = max(v.shape[1] for v in values)
        values = [v if v.shape[1] == width else torch.cat(
            [v, v.new_zeros((v.shape[0], width - v.shape[1], *v.shape[2:]))], dim=1)
            for v in values]
    return torch.cat(values, dim=0)


class Preprocessor:
    """Turns a prompt and its media items into model inputs, through the cache."""

    def __init__(self, loaded: LoadedModel, cache: ProcessorCache | None = None) -> None:
        self.loaded = loaded
        self.cache = cache or ProcessorCache(0)
        keep_channels_last(loaded.processor)
        tok = loaded.tokenizer
        self.expansion_ids = {m: tok.convert_tokens_to_ids(t)
                              for m, t in loaded.spec.expansion_tokens.items()}
        self._id_modality = {i: m for m, i in self.expansion_ids.items()}
        #: the token each modality's features fill (InternVL: its videos' <IMG_CONTEXT>)
        self.feature_ids = {m: tok.convert_tokens_to_ids(loaded.spec.feature_token(m))
                            for m in loaded.spec.expansion_tokens}
        self._prompt_ids: dict[str, list[int]] = {}
        # Qwen-VL processors also return mm_token_type_ids (1 image token, 2 video token);
        # Gemma 3's token_type_ids mark its image soft tokens.
        self.type_ids = {self.feature_ids[m]: v for m, v in loaded.spec.token_types.items()
                         if m in self.feature_ids}
        self._placeholder = re.compile("|".join(
            re.escape(t) for t in sorted(set(loaded.spec.expansion_tokens.values()), key=len,
                                         reverse=True)))
        self._token_modality = {t: m for m, t in loaded.spec.expansion_tokens.items()}
        self.shapes = (ShapeExpansions(loaded.processor)
                       if getattr(loaded.processor, "image_processor", None) is not None
                       else None)

    def _encode(self, text: str) -> list[int]:
        """A text's token ids. One that starts with the BOS token (Gemma 3's chat template
        writes it) gets no second one, as ``apply_chat_template(tokenize=True)`` does."""
        tok = self.loaded.tokenizer
        bos = tok.bos_token
        return list(tok(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])

    def _tokenize(self, prompt: str) -> list[int]:
        """Token ids of a prompt with unexpanded placeholders; prompts repeat (templates), so
        the last few hundred are remembered."""
        ids = self._prompt_ids.get(prompt)
        if ids is None:
            ids = self._encode(prompt)
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
        size = size_key(data) if item.modality == "image" and self.shapes is not None else None
        if item.modality == "image" and is_rgb_pil(data):
            data = channels_first_view(data)
            extra["input_data_format"] = "channels_first"
        known = (size, kwargs_key(extra)) if size is not None else None
        if item.modality == "video" and (spec.video_timestamps or item.metadata is not None):
            extra["do_sample_frames"] = False  # the engine sampled them; metadata says which
            if item.metadata is not None:
                # The clip's fps and the sampled frames: timestamps in the prompt (Qwen3-VL,
                # SmolVLM) and Qwen2.5-VL's seconds per temporal patch (its M-RoPE time axis)
                # come from them; without, the processor assumes 24 fps. A copy: the processor
                # extends an odd frames_indices list in place.
                extra["video_metadata"] = [copy.deepcopy(item.metadata)]
        if known is not None:
            with _processor_errors(item.modality):
                short = self.shapes.shortcut(*known, data, extra)
            if short is not None:
                tensors, remembered = short
                return _item(tensors, list(remembered.ids), remembered.count, remembered.text)
        if spec.assemble_text:
            extra["return_text_replacement_offsets"] = True
        with _processor_errors(item.modality):
            out = self.loaded.processor(text=[spec.placeholders[item.modality]],
                                        **{_ARG[item.modality]: [data]}, return_tensors="pt",
                                        **extra)
        ids = out["input_ids"][0].tolist()
        expansion = self._expansion(item.modality, ids)
        count = expansion.count(self.feature_ids[item.modality])
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        text = None
        if spec.assemble_text:
            (replaced,) = out["text_replacement_offsets"][0]
            text = replaced["replacement"]
        if known is not None:
            self.shapes.learn(*known, data, extra, Expansion(tuple(expansion), count, text),
                              tensors)
        return _item(tensors, expansion, count, text)

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
                salt: str | None = None) -> ProcessedPrompt:
        """Cache lookup (and, on a miss, decode + process) per item, then assembly; ``salt``
        (``cache_salt``) goes into every item's key, so no cache entry is shared across
        salts."""
        kwargs = kwargs or {}
        timings = zero_preprocess_timings()
        placeholders = count_placeholders(prompt, self.loaded.spec)
        counts = Counter(i.modality for i in items)
        for modality in set(placeholders) | set(counts):
            if placeholders.get(modality, 0) != counts.get(modality, 0):
                raise InvalidRequestError(
                    f"the prompt has {placeholders.get(modality, 0)} {modality} placeholder(s) "
                    f"for {counts.get(modality, 0)} {modality} item(s)",
                    code="placeholder_mismatch", param="prompt")
        check_one_visual_modality(counts, self.loaded.spec)
        processed: list[ProcessedItem] = []
        hits: list[bool] = []
        keys: list[str] = []
        for index, item in enumerate(items):
            start = time.perf_counter()
            # always: the engine's prefix cache names the item by it too
            key = salted_key(item_key(self.loaded.name, item.modality,
                                      content_hash(item.hash_source()), kwargs,
                                      item.media_kwargs), salt)
            keys.append(key)
            mid = time.perf_counter()
            timings["hash_s"] += mid - start
            cached = self.cache.get(key) if self.cache.enabled else None
            timings["cache_lookup_s"] += time.perf_counter() - mid
            if cached is not None:
                processed.append(cached)
                hits.append(True)
                continue
            start = time.perf_counter()
            try:
                data = item.decoded if item.decoded is not None else item.decode()  # type: ignore[misc]
            except ClientError as err:
                raise name_item(err, index, item.modality) from None
            timings["media_decode_s"] += time.perf_counter() - start
            start = time.perf_counter()
            result = self.process_item(item, data, kwargs)
            timings["processor_s"] += time.perf_counter() - start
            if self.cache.enabled:
                self.cache.put(key, result, result.nbytes)
            processed.append(result)
            hits.append(False)
        start = time.perf_counter()
        input_ids, mm, order = self._assemble(prompt, items, processed)
        timings["processor_s"] += time.perf_counter() - start
        return ProcessedPrompt(input_ids, mm, hits, timings, dict(counts),
                               [keys[i] for i in order],
                               self.item_positions(input_ids, [processed[i] for i in order]),
                               cache_salt=salt)

    def item_positions(self, input_ids: list[int], placed: list[ProcessedItem]
                       ) -> list[tuple[int, int]]:
        """(offset, length) of each placed item's feature tokens, first to last: item ``k``
        holds the feature tokens after those of the items before it. Where the prompt's
        feature tokens do not add up to the items' counts, every item is said to reach from
        the first feature token to the end (less reuse, never a wrong one)."""
        features = set(self.feature_ids.values())
        at = [i for i, t in enumerate(input_ids) if t in features]
        if len(at) != sum(p.num_tokens for p in placed) or any(
                p.num_tokens < 1 for p in placed):
            first = at[0] if at else 0
            return [(first, len(input_ids) - first)] * len(placed)
        out: list[tuple[int, int]] = []
        seen = 0
        for result in placed:
            first, last = at[seen], at[seen + result.num_tokens - 1]
            out.append((first, last - first + 1))
            seen += result.num_tokens
        return out

    def assemble(self, prompt: str, items: list[MediaItem], processed: list[ProcessedItem]
                 ) -> tuple[list[int], dict[str, Any]]:
        input_ids, mm, _ = self._assemble(prompt, items, processed)
        return input_ids, mm

    def _assemble(self, prompt: str, items: list[MediaItem], processed: list[ProcessedItem]
                  ) -> tuple[list[int], dict[str, Any], list[int]]:
        """The prompt's ids and tensors, and the items' indices in the order their
        placeholders come."""
        import torch

        queues: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            queues.setdefault(item.modality, []).append(i)
        order = {m: iter(q) for m, q in queues.items()}
        input_ids: list[int] = []
        placed: list[ProcessedItem] = []  # the items in the order their placeholders come
        placed_at: list[int] = []
        if self.loaded.spec.assemble_text:
            # The expansions' text meets the prompt's (Gemma 3: "user\n" + "\n\n<image>..."
            # is one "\n\n\n" token): put each item's text in, then tokenize once.
            pieces: list[str] = []
            last = 0
            for found in self._placeholder.finditer(prompt):
                placed_at.append(next(order[self._token_modality[found.group()]]))
                placed.append(processed[placed_at[-1]])
                pieces += [prompt[last:found.start()], placed[-1].text or ""]
                last = found.end()
            input_ids = self._encode("".join(pieces) + prompt[last:])
        else:
            # Tokenize once with the placeholders unexpanded, then put each item's expansion
            # in place of its placeholder token: that token is an added special token (so are
            # the markers around any text an expansion holds), so this equals tokenizing the
            # expanded text (what the HF processor does) at a fraction of the cost.
            for token in self._tokenize(prompt):
                modality = self._id_modality.get(token)
                if modality:
                    placed_at.append(next(order[modality]))
                    placed.append(processed[placed_at[-1]])
                    input_ids.extend(placed[-1].expansion)
                else:
                    input_ids.append(token)
        # Tensors in prompt order: families whose images and videos share a key (InternVL's
        # pixel_values) get them interleaved as the processor interleaves them.
        mm: dict[str, Any] = {}
        for result in placed:
            for key, value in result.tensors.items():
                mm.setdefault(key, []).append(value)
        spec = self.loaded.spec
        # One item: its cached tensors as they are (the model never writes into its inputs).
        merged = {k: v[0] if len(v) == 1 else torch.cat(v, dim=1) if k in spec.row_item_keys
                  else concat(v, k in spec.padded_keys) if hasattr(v[0], "dim") else v
                  for k, v in mm.items()}
        if self.type_ids:
            ids = torch.tensor([input_ids], dtype=torch.long)
            types = torch.zeros_like(ids)
            for token, value in self.type_ids.items():
                types[ids == token] = value
            merged[self.loaded.spec.token_types_key] = types
        return input_ids, merged, placed_at
