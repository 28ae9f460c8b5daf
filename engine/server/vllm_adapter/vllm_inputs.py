"""Decoded media for ``--engine vllm``: how an API server packs a request's items into
:class:`~engine.server.process.wire.Submit`'s ``mm`` and how the vLLM bridge unpacks them into
vLLM's
``multi_modal_data``.

vLLM runs its own processor, so the engine gets the decoded items, not processed tensors:
images as ``(H, W, 3)`` uint8 RGB arrays, videos as ``(T, H, W, 3)`` uint8 frames with the
metadata vLLM's video loaders attach (the sampled indices, fps, duration; Hugging Face's
``video_metadata``), audio as float32 samples with their rate. Arrays go through shared memory
(:mod:`engine.server.process.shared_inputs`) like any large input. Stdlib and numpy only: the bridge
imports this in vLLM's environment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MODALITIES = ("image", "video", "audio")
#: the bridge's error code for a request with a left-out item that vLLM no longer holds
#: (see :mod:`engine.server.vllm_adapter.vllm_media`)
DATA_NEEDED = "mm_data_needed"


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


def pack(items: list[tuple[str, Any, dict[str, Any] | None, str | None]]) -> dict[str, Any]:
    """``(modality, decoded, metadata, uuid)`` per item, in prompt order -> ``Submit.mm``:
    keys ``image.0``, ``video.0`` (+ ``video.0.meta``), ``audio.0`` (+ ``audio.0.rate``), and
    ``<key>.uuid`` for an item with a name (see :mod:`engine.server.vllm_adapter.vllm_media`).
    ``decoded``
    None: the item is left out (vLLM holds it under its uuid)."""
    out: dict[str, Any] = {}
    seen = dict.fromkeys(MODALITIES, 0)
    for modality, decoded, metadata, uuid in items:
        if modality not in seen:
            raise ValueError(f"unknown modality {modality!r}")
        key = f"{modality}.{seen[modality]}"
        seen[modality] += 1
        if uuid is not None:
            out[f"{key}.uuid"] = uuid
        if decoded is None:
            if uuid is None:
                raise ValueError(f"{key} has neither data nor a uuid")
            out[key] = None
        elif modality == "image":
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
    return out


def unpack(mm: dict[str, Any]) -> dict[str, list[Any]]:
    """``Submit.mm`` (its arrays mapped) -> ``{modality: [item, ...]}`` in prompt order:
    image arrays, ``(frames, metadata)`` and ``(samples, rate)`` as vLLM takes them, None for
    an item left out."""
    out: dict[str, list[Any]] = {}
    for modality in MODALITIES:
        for index in range(_count(mm, modality)):
            key = f"{modality}.{index}"
            value = mm[key]
            if value is not None and modality == "video":
                value = (value, dict(mm.get(f"{key}.meta") or {}))
            elif value is not None and modality == "audio":
                value = (value, int(mm[f"{key}.rate"]))
            out.setdefault(modality, []).append(value)
    return out


def left_out(mm: dict[str, Any]) -> bool:
    """Whether ``Submit.mm`` leaves an item's data out (vLLM's cache is to supply it)."""
    return any(mm.get(f"{m}.{i}") is None
               for m in MODALITIES for i in range(_count(mm, m)))


def _count(mm: dict[str, Any], modality: str) -> int:
    count = 0
    while f"{modality}.{count}" in mm:
        count += 1
    return count


def uuids(mm: dict[str, Any]) -> dict[str, list[str | None]]:
    """``Submit.mm``'s item names per modality, as vLLM's ``multi_modal_uuids`` (only the
    modalities with at least one named item)."""
    out: dict[str, list[str | None]] = {}
    for modality in MODALITIES:
        names = [mm.get(f"{modality}.{i}.uuid") for i in range(_count(mm, modality))]
        if any(names):
            out[modality] = names
    return out
