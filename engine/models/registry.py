"""The multimodal model registry: one entry per family.

Each entry declares the Hugging Face classes, the modalities the family accepts with the most
items per prompt its processor takes, the placeholder text raw prompts use, the token the
processor repeats per item, whether its tokenizer ships a chat template, and how to build a
tiny random instance. A model folder is matched by its config's ``architectures``/``model_type``.

``token_types``: the ``mm_token_type_ids`` values the processor gives each modality's feature
token (its expansion token unless ``feature_tokens`` names another). ``video_timestamps``: the
family writes each temporal patch's time into the prompt, so its processor gets the video's
metadata (fps, sampled frame indices) and frames it must not resample.

``padded_keys``: processor outputs whose items differ in their second dimension
(LLaVA-OneVision's tiles per image): zero-padded at its end to the longest when items or rows are
concatenated, as the processor pads a batch (the model reads only each item's own tiles).
``feature_tokens``: the token the model fills with a modality's features where it is not the
expansion token (InternVL expands ``<video>`` to frames of ``<IMG_CONTEXT>``; Gemma 3 its
``<start_of_image>`` to ``<image_soft_token>``s). ``token_types_key``: the processor output that
holds ``token_types`` (Gemma 3: ``token_type_ids``). ``bidirectional_media``: the model attends
both ways within each image's tokens, reading the token types by position over the whole cache
(a prefill chunk gets them from the prompt's start). ``assemble_text``: an expansion holds text
that meets the prompt's own (Gemma 3's blank lines around each image, its pan-and-scan
sentences), so per-item ids cannot be spliced: prompts are assembled as text from each item's
cached replacement text and tokenized once, as the processor does.

``row_item_keys``: processor outputs that hold a prompt's items along their second dimension
(SmolVLM's ``pixel_values``: one row of all its images' tiles); a prompt's items are joined
there, rows on the first dimension (these keys are ``padded_keys`` too: the model drops the
all-zero padding tiles). ``one_visual_modality``: the processor writes images and video
frames to the same key, so one prompt may hold images or videos, not both (refused with a 400).
``resume_in_media``: a prefill may resume inside a prompt's media span, from the embeddings the
model's own forward merges (:mod:`engine.executor.media_embeds`); not where media features
also enter deeper layers (Qwen3-VL's deepstack) or attention runs both ways within an image
(Gemma 3): a cached prefix is cut back to the span's start there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    model_class: str
    processor_class: str
    max_items: dict[str, int]
    placeholders: dict[str, str]
    expansion_tokens: dict[str, str]
    ships_chat_template: bool
    encoder_attr: str
    builder: str
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    token_types: dict[str, int] = field(default_factory=dict)
    video_timestamps: bool = False
    padded_keys: tuple[str, ...] = ()
    feature_tokens: dict[str, str] = field(default_factory=dict)
    token_types_key: str = "mm_token_type_ids"
    bidirectional_media: bool = False
    assemble_text: bool = False
    row_item_keys: tuple[str, ...] = ()
    one_visual_modality: bool = False
    #: pixel tensors whose rescale + normalize may run on the model's device (vLLM's
    #: --mm-device-do-normalize): tensor name -> the processor part whose statistics apply
    normalize_on_device: dict[str, str] = field(default_factory=dict)
    resume_in_media: bool = True

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.max_items)

    def feature_token(self, modality: str) -> str:
        """The token an item of ``modality`` fills with its features in the expanded prompt."""
        return self.feature_tokens.get(modality, self.expansion_tokens[modality])

    def build_tiny(self, out: Path, seed: int = 0) -> None:
        module, func = self.builder.rsplit(":", 1)
        fn: Callable[[Path, int], None] = getattr(importlib.import_module(module), func)
        fn(Path(out), seed)


_QWEN_PLACEHOLDERS = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                      "video": "<|vision_start|><|video_pad|><|vision_end|>"}
_QWEN_EXPANSION = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
_QWEN_TYPES = {"image": 1, "video": 2}
_QWEN_DEVICE_NORM = {"pixel_values": "image_processor", "pixel_values_videos": "video_processor"}


def _hf(name: str, prefix: str) -> dict[str, Any]:
    """A family's Hugging Face names as transformers spells them: ``<prefix>ForConditional
    Generation`` is its architecture and model class, ``<prefix>Processor`` its processor
    class, ``name`` its model type."""
    model = f"{prefix}ForConditionalGeneration"
    return {"name": name, "architectures": (model,), "model_types": (name,),
            "model_class": model, "processor_class": f"{prefix}Processor"}


REGISTRY: dict[str, ArchSpec] = {
    spec.name: spec for spec in (
        ArchSpec(**_hf("qwen2_5_vl", "Qwen2_5_VL"), max_items={"image": 32, "video": 8},
                 placeholders=_QWEN_PLACEHOLDERS, expansion_tokens=_QWEN_EXPANSION,
                 ships_chat_template=True, encoder_attr="visual",
                 builder="engine.models.tiny:build_qwen2_5_vl", token_types=_QWEN_TYPES,
                 normalize_on_device=_QWEN_DEVICE_NORM),
        ArchSpec(**_hf("qwen2_vl", "Qwen2VL"), max_items={"image": 32, "video": 8},
                 placeholders=_QWEN_PLACEHOLDERS, expansion_tokens=_QWEN_EXPANSION,
                 ships_chat_template=True, encoder_attr="visual",
                 builder="engine.models.tiny:build_qwen2_vl", token_types=_QWEN_TYPES,
                 normalize_on_device=_QWEN_DEVICE_NORM),
        ArchSpec(**_hf("qwen3_vl", "Qwen3VL"), max_items={"image": 32, "video": 8},
                 placeholders=_QWEN_PLACEHOLDERS, expansion_tokens=_QWEN_EXPANSION,
                 ships_chat_template=True, encoder_attr="visual",
                 builder="engine.models.tiny:build_qwen3_vl", token_types=_QWEN_TYPES,
                 video_timestamps=True, normalize_on_device=_QWEN_DEVICE_NORM,
                 resume_in_media=False,
                 notes="Qwen3-VL: a video expands to <t seconds><|vision_start|>...<|vision_end|> "
                       "per temporal patch; timestamps come from the clip's fps"),
        ArchSpec(**_hf("llava", "Llava"), max_items={"image": 1},
                 placeholders={"image": "<image>"}, expansion_tokens={"image": "<image>"},
                 ships_chat_template=False, encoder_attr="vision_tower",
                 builder="engine.models.tiny:build_llava",
                 notes="LLaVA-1.5: its tokenizer ships no chat template; pass --chat-template"),
        ArchSpec(**_hf("qwen2_audio", "Qwen2Audio"), max_items={"audio": 8},
                 placeholders={"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"},
                 expansion_tokens={"audio": "<|AUDIO|>"}, ships_chat_template=True,
                 encoder_attr="audio_tower", builder="engine.models.tiny:build_qwen2_audio"),
        ArchSpec(**_hf("llava_onevision", "LlavaOnevision"), max_items={"image": 16, "video": 4},
                 placeholders={"image": "<image>", "video": "<video>"},
                 expansion_tokens={"image": "<image>", "video": "<video>"},
                 ships_chat_template=True, encoder_attr="vision_tower",
                 builder="engine.models.tiny_vlm:build_llava_onevision",
                 padded_keys=("pixel_values",),
                 notes="LLaVA-OneVision: each image tiled (anyres_max_9) as a single image; "
                       "video frames pooled"),
        ArchSpec(**_hf("internvl", "InternVL"), max_items={"image": 16, "video": 4},
                 placeholders={"image": "<IMG_CONTEXT>", "video": "<video>"},
                 expansion_tokens={"image": "<IMG_CONTEXT>", "video": "<video>"},
                 ships_chat_template=True, encoder_attr="vision_tower",
                 builder="engine.models.tiny_vlm:build_internvl",
                 feature_tokens={"video": "<IMG_CONTEXT>"},
                 notes="InternVL3: an image is up to 12 tiles and a thumbnail; a video frame is "
                       "one tile, written Frame<i>: <img>...</img>"),
        ArchSpec(**_hf("gemma3", "Gemma3"), max_items={"image": 16},
                 placeholders={"image": "<start_of_image>"},
                 expansion_tokens={"image": "<start_of_image>"}, ships_chat_template=True,
                 encoder_attr="vision_tower", builder="engine.models.tiny_vlm:build_gemma3",
                 feature_tokens={"image": "<image_soft_token>"}, token_types={"image": 1},
                 token_types_key="token_type_ids", bidirectional_media=True, assemble_text=True,
                 resume_in_media=False,
                 notes="Gemma 3: sliding-window and global layers; an image is 256 tokens, "
                       "more with pan-and-scan crops (do_pan_and_scan)"),
        ArchSpec(**_hf("smolvlm", "SmolVLM"), max_items={"image": 8, "video": 1},
                 placeholders={"image": "<image>", "video": "<video>"},
                 expansion_tokens={"image": "<image>", "video": "<video>"},
                 ships_chat_template=True, encoder_attr="vision_model",
                 builder="engine.models.tiny_vlm:build_smolvlm",
                 feature_tokens={"video": "<image>"}, video_timestamps=True, assemble_text=True,
                 padded_keys=("pixel_values", "pixel_attention_mask"),
                 row_item_keys=("pixel_values", "pixel_attention_mask"), one_visual_modality=True,
                 notes="SmolVLM2: an image is split into tiles (up to 4x4) plus a global view "
                       "(do_image_splitting); a video is timestamped frames; images or a "
                       "video per prompt, not both"),
    )
}
DEFAULT_ARCH = "qwen2_5_vl"


def get_arch(name: str) -> ArchSpec:
    """A registered family by name; the error lists the supported ones."""
    key = name.strip().lower().replace("-", "_").replace(".", "_")
    if key not in REGISTRY:
        raise ConfigError(f"unknown architecture {name!r}; supported: "
                          f"{', '.join(REGISTRY)}", code="unknown_architecture")
    return REGISTRY[key]


def arch_for_config(config: dict[str, Any], where: str) -> ArchSpec:
    """The family of a model folder's ``config.json``."""
    architectures = tuple(config.get("architectures") or ())
    model_type = config.get("model_type")
    for spec in REGISTRY.values():
        if set(architectures) & set(spec.architectures) or model_type in spec.model_types:
            return spec
    supported = ", ".join(a for s in REGISTRY.values() for a in s.architectures)
    raise ConfigError(
        f"the model at {where} is a {', '.join(architectures) or model_type or 'unknown'} "
        f"model, which this toolkit does not support; supported architectures: {supported}",
        code="unknown_architecture")
