"""Decoded media for ``--engine vllm``: how an API server packs a request's items into
:class:`~engine.server.wire.Submit`'s ``mm`` and how the vLLM bridge unpacks them into vLLM's
``multi_modal_data``.

vLLM runs its own processor, so the engine gets the decoded items, not processed tensors:
images as ``(H, W, 3)`` uint8 RGB arrays, videos as ``(T, H, W, 3)`` uint8 frames with the
metadata vLLM's video loaders attach (the sampled indices, fps, duration; Hugging Face's
``video_metadata``), audio as float32 samples with their rate. Arrays go through shared memory
(:mod:`engine.server.shared_inputs`) like any large input. Stdlib and numpy only: the bridge
imports this in vLLM's environment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MODALITIES = ("image", "video", "audio")


def video_metadata(metadata: dict[str, Any] | None, num_frames: int) -> dict[str, Any]:
    """A decoded clip's metadata as vLLM's video loaders give it to the processor: the
    frames were sampled already, unless every frame was kept (vLLM's own rule)."""
    meta = dict(metadata or {})
    indices = list(meta.get("frames_indices") or range(num_frames))
    meta["frames_indices"] = indices
    total = int(meta.get("total_num_frames") or len(indices))
    meta["total_num_frames"] = total
    meta["do_sample_frames"] = len(indices) == total
    return meta


def pack(items: list[tuple[str, Any, dict[str, Any] | None]]) -> dict[str, Any]:
    """``(modality, decoded, metadata)`` per item, in prompt order -> ``Submit.mm``: keys
    ``image.0``, ``video.0`` (+ ``video.0.meta``), ``audio.0`` (+ ``audio.0.rate``)."""
    out: dict[str, Any] = {}
    seen = dict.fromkeys(MODALITIES, 0)
    for modality, decoded, metadata in items:
        key = f"{modality}.{seen[modality]}"
        seen[modality] += 1
        if modality == "image":
            out[key] = np.ascontiguousarray(np.asarray(decoded.convert("RGB")) if hasattr(
                decoded, "convert") else np.asarray(decoded), dtype=np.uint8)
        elif modality == "video":
            frames = np.ascontiguousarray(np.asarray(decoded), dtype=np.uint8)
            out[key] = frames
            out[f"{key}.meta"] = video_metadata(metadata, len(frames))
        elif modality == "audio":
            samples, rate = decoded
            out[key] = np.ascontiguousarray(np.asarray(samples), dtype=np.float32)
            out[f"{key}.rate"] = int(rate)
        else:
            raise ValueError(f"unknown modality {modality!r}")
    return out


def unpack(mm: dict[str, Any]) -> dict[str, list[Any]]:
    """``Submit.mm`` (its arrays mapped) -> ``{modality: [item, ...]}`` in prompt order:
    image arrays, ``(frames, metadata)`` and ``(samples, rate)`` as vLLM takes them."""
    out: dict[str, list[Any]] = {}
    for modality in MODALITIES:
        index = 0
        while f"{modality}.{index}" in mm:
            key = f"{modality}.{index}"
            value = mm[key]
            if modality == "video":
                value = (value, dict(mm.get(f"{key}.meta") or {}))
            elif modality == "audio":
                value = (value, int(mm[f"{key}.rate"]))
            out.setdefault(modality, []).append(value)
            index += 1
    return out
