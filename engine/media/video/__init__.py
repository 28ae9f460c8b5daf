"""Video decoding: one sampler, one container scan, a registry of backends.

``load_video(data, spec, limits)`` scans the container once (true frame count, fps, rotation),
picks the frame indices with the shared sampler, and asks the chosen backend for exactly those
frames. Every backend returns the same frames for the same clip and request.

The names below are imported on first use, so importing a light submodule (such as
``backend_info``, which ``engine.envs`` reads) does not import the decoders.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VideoFrames": "loader", "VideoMetadata": "loader", "load_video": "loader",
    "load_video_async": "loader", "VideoLoadSpec": "options",
    "parse_video_io_kwargs": "options", "SamplingRequest": "sampling",
    "sample_indices": "sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
