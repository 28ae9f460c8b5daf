"""The clip kinds every CPU video backend must decode exactly, and the ffmpeg CLI reference."""

from __future__ import annotations

import functools
import subprocess

import numpy as np

from engine.media import synthetic

CLIPS: dict[str, dict] = {
    "h264-bframes-long-gop": dict(width=160, height=120, seconds=3, gop=90, bframes=3),
    "hevc": dict(width=160, height=120, seconds=1, codec="libx265", bframes=2),
    "vp9-webm": dict(width=160, height=120, seconds=1, codec="libvpx-vp9", container="webm"),
    "av1": dict(width=160, height=128, seconds=1, codec="libsvtav1"),
    "odd-dimensions": dict(width=67, height=45, seconds=1, pix_fmt="yuv444p"),
    "rotated-90": dict(width=160, height=96, seconds=1, rotation=90),
    "variable-frame-rate": dict(width=160, height=120, frame_times=[
        0, 0.03, 0.05, 0.2, 0.21, 0.5, 0.52, 0.9, 0.95, 1.4, 1.41, 1.42, 2.0]),
    "10-bit": dict(width=160, height=120, seconds=1, pix_fmt="yuv420p10le"),
    "mkv-no-frame-count": dict(width=160, height=120, seconds=1, container="matroska"),
}


@functools.cache
def clip(name: str) -> bytes:
    return synthetic.make_video(**CLIPS[name])


@functools.cache
def reference_frames(name: str, path: str) -> np.ndarray:
    """Every frame as the ffmpeg CLI decodes it to RGB24 (rotation applied, no frame-rate
    conversion), shaped (N, H, W, 3)."""
    out = subprocess.run(["ffmpeg", "-v", "error", "-i", path, "-fps_mode", "passthrough",
                          "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
                         capture_output=True, check=True).stdout
    spec = CLIPS[name]
    h, w = spec["height"], spec["width"]
    if spec.get("rotation", 0) % 180:
        h, w = w, h
    return np.frombuffer(out, np.uint8).reshape(-1, h, w, 3)
