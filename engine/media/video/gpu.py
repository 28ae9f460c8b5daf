"""Startup checks for the GPU video backends.

A GPU backend decodes in the API server process while the engine process holds the model, so
two CUDA processes share the GPU: that needs a CUDA MPS daemon, and a positive
``--mm-ipc-gpu-memory-gb`` that the engine leaves free for decoding.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import ConfigError
from engine.media.video.backend_info import BACKENDS
from engine.media.video.options import VideoLoadSpec


def mps_running(pipe_dir: str | None = None) -> bool:
    """Whether a CUDA MPS control daemon is up (its control pipe exists)."""
    folder = Path(pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (folder / "control").exists()


def check_gpu_backend_startup(spec: VideoLoadSpec, mm_ipc_gpu_memory_gb: float,
                              *, mps_pipe_dir: str | None = None) -> None:
    """Refuse to start a GPU video backend without its prerequisites (says how to fix)."""
    if not BACKENDS[spec.backend].needs_mps:
        return
    if not mm_ipc_gpu_memory_gb or mm_ipc_gpu_memory_gb <= 0:
        raise ConfigError(
            "the pynvvideocodec video backend needs GPU memory set aside for decoding",
            hint="pass --mm-ipc-gpu-memory-gb N (e.g. 4) so the engine leaves N GB free",
            code="gpu_decode_budget_missing")
    if not mps_running(mps_pipe_dir):
        raise ConfigError(
            "the pynvvideocodec video backend needs a running CUDA MPS daemon (the API server "
            "and the engine share the GPU)",
            hint="start it with `nvidia-cuda-mps-control -d` (as the same user), or use a CPU "
                 "video backend", code="cuda_mps_not_running")
