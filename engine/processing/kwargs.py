"""``mm_processor_kwargs``: server-wide (``--mm-processor-kwargs``) merged with the request's
(the request wins), and checked against what the processor accepts: an unknown key is a
client error, not silently ignored."""

from __future__ import annotations

import inspect
from typing import Any

from engine.errors import InvalidRequestError

_SUBPROCESSORS = ("image_processor", "video_processor", "feature_extractor")


def accepted_kwargs(processor: Any) -> set[str]:
    """Keys the processor's image/video/audio sub-processors take."""
    names: set[str] = set()
    for attr in _SUBPROCESSORS:
        sub = getattr(processor, attr, None)
        if sub is None:
            continue
        params = inspect.signature(type(sub).__init__).parameters
        names |= {n for n, p in params.items() if n != "self" and p.kind not in (
            p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        names |= {k for k in sub.to_dict() if not k.startswith("_")}
        names |= set(getattr(sub, "valid_kwargs", {}).__annotations__
                     if hasattr(getattr(sub, "valid_kwargs", None), "__annotations__") else ())
    return names - {"processor_class", "image_processor_type", "video_processor_type",
                    "feature_extractor_type", "auto_map"}


def merge_processor_kwargs(processor: Any, server: dict[str, Any] | None,
                           request: dict[str, Any] | None) -> dict[str, Any]:
    """Server kwargs with the request's on top, validated."""
    merged = {**(server or {}), **(request or {})}
    if not merged:
        return {}
    allowed = accepted_kwargs(processor)
    unknown = sorted(k for k in merged if k not in allowed)
    if unknown:
        examples = ", ".join(sorted(k for k in allowed if k in (
            "min_pixels", "max_pixels", "fps", "size", "do_resize", "sampling_rate",
            "num_frames", "max_length", "crop_size")))
        raise InvalidRequestError(
            f"mm_processor_kwargs key(s) {', '.join(unknown)} are not accepted by this model's "
            f"processor", hint=f"remove them; accepted keys include {examples or 'none'}",
            code="invalid_mm_processor_kwargs", param="mm_processor_kwargs")
    return merged
