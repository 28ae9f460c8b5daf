"""The video backends, one record each: every list and check about backends derives from
:data:`BACKENDS` (the env var's choices, the registry's imports and install hints, which are
GPU backends, which options are fixed at start, which need a CUDA MPS daemon); each backend's
typed options are its class in :mod:`engine.media.video.options` (``options_cls``).

To add a backend: a module in ``backends/`` exposing ``BACKEND``, its options class in
``options.py``, and one record here. Light on purpose (no imports): ``engine.envs`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # imported only when the backend is first used
    install_hint: str  # what to install when the import fails
    gpu: bool = False  # decodes on the GPU: holds --mm-ipc-gpu-memory-gb, server-wide only
    startup_only: tuple[str, ...] = ()  # options fixed when the server starts
    needs_mps: bool = False  # a CUDA context in the API server next to the engine's

    @property
    def options_cls(self) -> Any:
        from engine.media.video.options import OPTION_CLASSES

        return OPTION_CLASSES[self.name]


_PACKAGE = "engine.media.video.backends"
BACKENDS: dict[str, BackendInfo] = {info.name: info for info in (
    BackendInfo("opencv", f"{_PACKAGE}.opencv", "opencv-python-headless"),
    BackendInfo("pyav", f"{_PACKAGE}.pyav", "av"),
    BackendInfo("torchcodec", f"{_PACKAGE}.torchcodec", "torchcodec"),
    BackendInfo("pynvvideocodec", f"{_PACKAGE}.pynvvideocodec",
                "PyNvVideoCodec (pip install 'aphrodite-toolkit[nvidia]')", gpu=True,
                startup_only=("hw_decoders", "gpu_id"), needs_mps=True),
    BackendInfo("deepstream", f"{_PACKAGE}.deepstream",
                "GStreamer's Python bindings (python3-gi, python3-gst-1.0)", gpu=True,
                startup_only=("pool_size",)),
)}
NAMES: tuple[str, ...] = tuple(BACKENDS)
CPU_NAMES: tuple[str, ...] = tuple(n for n, info in BACKENDS.items() if not info.gpu)
GPU_NAMES: frozenset[str] = frozenset(n for n, info in BACKENDS.items() if info.gpu)
