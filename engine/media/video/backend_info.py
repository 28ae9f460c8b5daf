"""The video backends, one record each: every list and check about backends derives from
:data:`BACKENDS` (the registry's imports and install hints, which are GPU backends, which
options are fixed at start, which need a CUDA MPS daemon); each backend's typed options are
its class in :mod:`engine.media.video.options` (``OPTION_CLASSES``, keyed by the same names).

To add a backend: a module in ``backends/`` exposing ``BACKEND``, its options class in
``options.py``, one record here, and its name in ``engine.envs.VIDEO_BACKENDS`` (the
environment variable's choices; the bottom layer imports nothing from media, and a test holds
the two lists equal). Light on purpose: no imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BackendInfo:
    name: str
    module: str  # imported only when the backend is first used
    install_hint: str  # what to install when the import fails
    gpu: bool = False  # decodes on the GPU: holds --mm-ipc-gpu-memory-gb, server-wide only
    startup_only: tuple[str, ...] = ()  # options fixed when the server starts
    needs_mps: bool = False  # a CUDA context in the API server next to the engine's


_PACKAGE = "engine.media.video.backends"
BACKENDS: dict[str, BackendInfo] = {info.name: info for info in (
    BackendInfo(name="opencv", module=f"{_PACKAGE}.opencv",
                install_hint="opencv-python-headless"),
    BackendInfo(name="pyav", module=f"{_PACKAGE}.pyav", install_hint="av"),
    BackendInfo(name="torchcodec", module=f"{_PACKAGE}.torchcodec", install_hint="torchcodec"),
    BackendInfo(name="pynvvideocodec", module=f"{_PACKAGE}.pynvvideocodec",
                install_hint="PyNvVideoCodec (pip install 'aphrodite-toolkit[nvidia]')",
                gpu=True, startup_only=("hw_decoders", "gpu_id"), needs_mps=True),
    BackendInfo(name="deepstream", module=f"{_PACKAGE}.deepstream",
                install_hint="GStreamer's Python bindings (python3-gi, python3-gst-1.0)",
                gpu=True, startup_only=("pool_size",)),
)}
NAMES: tuple[str, ...] = tuple(BACKENDS)
CPU_NAMES: tuple[str, ...] = tuple(n for n, info in BACKENDS.items() if not info.gpu)
GPU_NAMES: frozenset[str] = frozenset(n for n, info in BACKENDS.items() if info.gpu)
