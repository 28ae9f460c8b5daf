"""The clip kinds every CPU video backend must decode exactly, and the ffmpeg CLI reference."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import numpy as np

from tests.fixtures import synthetic

RECIPES = json.loads((Path(__file__).resolve().parents[1] / "datasets" / "recipes"
                      / "video-clips.json").read_text())
CLIPS: dict[str, dict] = {k: v for k, v in RECIPES.items() if k != "about"}


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
