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


def family_kwargs(spec: Any) -> list[str]:
    """The processor kwargs a family's own sub-processor classes add to the common ones
    (``size``, ``do_resize``, ``fps``, ``num_frames``, ``sampling_rate``...): Qwen-VL's
    ``max_pixels``, Gemma 3's ``do_pan_and_scan``, SmolVLM's ``do_image_splitting``. Read from
    the classes transformers maps the family's ``model_type`` to, without loading a model."""
    import transformers
    from transformers.models.auto import (
        feature_extraction_auto,
        image_processing_auto,
        video_processing_auto,
    )
    from transformers.processing_utils import AudioKwargs, ImagesKwargs, VideosKwargs

    common = (set(ImagesKwargs.__annotations__) | set(VideosKwargs.__annotations__)
              | set(AudioKwargs.__annotations__))
    own: set[str] = set()
    for mapping in (image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES,
                    video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES,
                    feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES):
        name = mapping.get(spec.model_types[0])
        if isinstance(name, dict):  # by backend: the torchvision one is what loads here
            name = name.get("torchvision") or next(iter(name.values()), None)
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None:
            continue
        own |= set(getattr(getattr(cls, "valid_kwargs", None), "__annotations__", None) or ())
        own |= {n for n, p in inspect.signature(cls.__init__).parameters.items()
                if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return sorted(k for k in own - common if not k.startswith("return_"))


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


#: The ``mm_processor_kwargs`` a *request* may set. The pixel budget may be lowered, never
#: raised past the server's own (so a 68-byte PNG cannot make the processor allocate
#: gigabytes); everything else (patch and merge sizes the model was built for, normalisation,
#: resampling) is the operator's, set with ``--mm-processor-kwargs``: a request changing it
#: could break the forward pass it shares with other requests.
REQUEST_KWARGS = ("min_pixels", "max_pixels", "fps")
MAX_REQUEST_FPS = 60.0


def pixel_cap(processor: Any, server: dict[str, Any] | None) -> int | None:
    """The most pixels per image or frame this server's processor produces: the operator's
    ``max_pixels``, else the largest of the sub-processors' own (``size.longest_edge``, which
    is a pixel count for the processors that take ``max_pixels``)."""
    if server and isinstance(server.get("max_pixels"), int):
        return server["max_pixels"]
    caps = []
    for attr in _SUBPROCESSORS:
        sub = getattr(processor, attr, None)
        size = getattr(sub, "size", None)
        longest = getattr(size, "longest_edge", None) if size is not None else None
        if isinstance(longest, int):
            caps.append(longest)
    return max(caps) if caps else None


def check_request_kwargs(processor: Any, server: dict[str, Any] | None,
                         request: dict[str, Any] | None) -> None:
    """A request's ``mm_processor_kwargs``: only :data:`REQUEST_KWARGS` the processor takes,
    of the right type, within the server's bounds; raises a 400 naming the key otherwise."""
    if not request:
        return
    allowed = accepted_kwargs(processor)
    settable = [k for k in REQUEST_KWARGS if k in allowed]
    for key in sorted(request):
        if key not in settable:
            raise InvalidRequestError(
                f"mm_processor_kwargs key {key!r} cannot be set per request",
                hint=f"a request may set {', '.join(settable) or 'none'}; the operator sets "
                     "other processor settings with --mm-processor-kwargs",
                code="invalid_mm_processor_kwargs", param=f"mm_processor_kwargs.{key}")
    cap = pixel_cap(processor, server)
    for key in ("min_pixels", "max_pixels"):
        value = request.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (
                cap is not None and value > cap):
            raise InvalidRequestError(
                f"mm_processor_kwargs {key}={value!r} must be a whole number of pixels from 1 "
                f"to {cap if cap is not None else 'the processor maximum'}",
                hint="this server's maximum comes from its processor or --mm-processor-kwargs "
                     "max_pixels", code="invalid_mm_processor_kwargs",
                param=f"mm_processor_kwargs.{key}")
    low, high = request.get("min_pixels"), request.get("max_pixels")
    if low is not None and high is not None and low > high:
        raise InvalidRequestError(
            f"mm_processor_kwargs min_pixels={low} is over max_pixels={high}",
            code="invalid_mm_processor_kwargs", param="mm_processor_kwargs.min_pixels")
    fps = request.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float)
                            or not 0 < fps <= MAX_REQUEST_FPS):
        raise InvalidRequestError(
            f"mm_processor_kwargs fps={fps!r} must be a number above 0 and at most "
            f"{MAX_REQUEST_FPS:g}", code="invalid_mm_processor_kwargs",
            param="mm_processor_kwargs.fps")
