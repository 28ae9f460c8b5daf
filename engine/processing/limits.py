"""Items per modality: counted before anything is fetched, against the effective limit
``min(--limit-mm-per-prompt, the family's own maximum)``; unsupported modalities have 0."""

from __future__ import annotations

from collections import Counter

from engine.errors import ConfigError, InvalidRequestError
from engine.models.registry import ArchSpec

MODALITIES = ("image", "video", "audio")


def effective_limits(spec: ArchSpec, limit_mm_per_prompt: dict[str, int] | None
                     ) -> dict[str, int]:
    """Per modality: the operator's limit capped by the model's (0 when not accepted)."""
    check_limit_flag(limit_mm_per_prompt)
    limits = {m: spec.max_items.get(m, 0) for m in MODALITIES}
    for modality, value in (limit_mm_per_prompt or {}).items():
        limits[modality] = min(value, limits[modality])
    return limits


def check_limit_flag(limit_mm_per_prompt: dict[str, int] | None) -> None:
    """``--limit-mm-per-prompt``'s own shape: known modalities, non-negative integers."""
    if limit_mm_per_prompt is None:
        return
    if not isinstance(limit_mm_per_prompt, dict):
        raise ConfigError("--limit-mm-per-prompt must be a JSON object such as "
                          '\'{"image": 4}\'', code="invalid_limit")
    for modality, value in limit_mm_per_prompt.items():
        if modality not in MODALITIES:
            raise ConfigError(f"--limit-mm-per-prompt names unknown modality {modality!r}",
                              hint=f"use {', '.join(MODALITIES)}", code="invalid_limit")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"--limit-mm-per-prompt {modality}={value!r} must be a "
                              "non-negative integer", code="invalid_limit")


def check_item_counts(counts: Counter[str] | dict[str, int], limits: dict[str, int],
                      spec: ArchSpec, requested: dict[str, int] | None) -> None:
    """Refuse (400) a prompt with more items of a modality than allowed, naming why."""
    check_one_visual_modality(counts, spec)
    for modality, count in counts.items():
        limit = limits.get(modality, 0)
        if count <= limit:
            continue
        model_max = spec.max_items.get(modality, 0)
        if model_max == 0:
            raise InvalidRequestError(
                f"this model ({spec.name}) does not accept {modality} input",
                hint=f"remove the {modality} parts or serve a model that accepts {modality}",
                code="modality_not_supported", param="messages")
        asked = (requested or {}).get(modality)
        by_model = asked is None or asked >= model_max
        why = (f"the model's own maximum is {model_max}" if by_model
               else "set by --limit-mm-per-prompt")
        raise InvalidRequestError(
            f"{count} {modality} items in one prompt, over the limit of {limit} ({why})",
            hint=("the model itself cannot take more; send fewer" if by_model else
                  f"send fewer or raise --limit-mm-per-prompt '{{\"{modality}\": N}}'"),
            code="too_many_mm_items", param="messages")


def check_one_visual_modality(counts: Counter[str] | dict[str, int], spec: ArchSpec) -> None:
    """A family whose processor puts images and video frames in one tensor (SmolVLM) takes
    one of them per prompt: both is a 400, before anything is fetched."""
    if spec.one_visual_modality and counts.get("image") and counts.get("video"):
        raise InvalidRequestError(
            f"this model ({spec.name}) takes images or a video in one prompt, not both (this "
            f"one has {counts['image']} image(s) and {counts['video']} video(s)): its "
            "processor puts both in one tensor", code="mixed_modalities_unsupported",
            param="messages", hint="send the images and the video in separate requests")
