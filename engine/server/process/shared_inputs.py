"""Model inputs from an API server to the engine process through shared memory.

A request's pixel values are megabytes (a 1280x720 image for Qwen2.5-VL: 5.6 MB of float32
patches; 16 frames of video: 15 MB). Pickled through the engine's pipe they were copied four
times, and the engine's connection thread spent about a sixth of the engine process's time
receiving them under load, beside the thread stepping the model. Arrays of at least
:data:`MIN_BYTES` are instead copied once into a ``/dev/shm`` segment; the pipe carries its
name; the engine maps it and removes the name at once (:func:`engine.media.frame_memory.attach`),
so the memory goes with the engine's last reference. Segments are named after the API server's
pid: ones a dead process left are removed by ``frame_memory.remove_orphans``. Without room in
``/dev/shm`` the array goes through the pipe as before.

An array that is a decode worker's segment as it came (``--engine vllm`` sends decoded media)
is handed over instead of copied (:func:`engine.media.frame_memory.hand_over`): renamed into
this process's names, mapped and removed by the engine like a copy.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.media import frame_memory

#: smaller arrays (grids, token type ids) cost less through the pipe than a segment does
MIN_BYTES = 1 << 16

_ids = itertools.count(1)


@dataclass(frozen=True)
class SharedArray:
    """Where an array waits for the engine: a segment's name and size, the array's shape."""

    name: str
    size: int
    shape: tuple[int, ...]
    dtype: str


def export(mm: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``mm`` with its large arrays copied into segments (a strided array straight into its
    segment's contiguous layout), and the segments' names
    (for :func:`discard` if the message never reaches the engine)."""
    out: dict[str, Any] = {}
    names: list[str] = []
    for key, value in mm.items():
        if isinstance(value, np.ndarray) and value.nbytes >= MIN_BYTES and \
                not value.dtype.hasobject:
            name = f"{os.getpid()}-in-{next(_ids)}"
            shared = frame_memory.hand_over(value, name) or frame_memory.share(value, name)
            if shared is not None:
                names.append(shared[0])
                out[key] = SharedArray(shared[0], shared[1], tuple(value.shape), value.dtype.str)
                continue
        out[key] = value
    return out, names


def discard(names: list[str]) -> None:
    """Remove segments that no engine will map (the send failed)."""
    for name in names:
        (frame_memory.SHM_DIR / Path(name).name).unlink(missing_ok=True)


def discard_all() -> int:
    """Remove every segment this process made that no engine mapped (the engine is gone, or
    this API server is stopping); how many."""
    return frame_memory.remove_segments(f"{os.getpid()}-in-")


def attach(mm: dict[str, Any]) -> dict[str, Any]:
    """In the engine: ``mm`` with each :class:`SharedArray` mapped (its name removed). Every
    segment is attached (and so removed) even when one fails; then the first error is raised."""
    out: dict[str, Any] = {}
    error: BaseException | None = None
    for key, value in mm.items():
        if isinstance(value, SharedArray):
            try:
                value = frame_memory.attach(value.name, value.size, value.shape, value.dtype)
            except (OSError, ValueError) as exc:
                error = error or exc
        out[key] = value
    if error is not None:
        raise error
    return out
