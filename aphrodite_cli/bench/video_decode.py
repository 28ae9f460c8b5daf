"""``aphrodite bench video-decode``: per-backend sampled-decode time on one clip.

Each repeat times, back to back on the same machine: the full-decode reference
(``ffmpeg -threads 2 -i CLIP -f null -``) and every backend decoding the same sampled frames.
Medians and the ratio to the reference median are reported (ratios, not absolute times, are
what survives a noisy shared machine), and every backend's frames are compared with an exact
full decode (PyAV without the skip path) so a fast wrong answer cannot pass.
"""

from __future__ import annotations

import io
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import MediaLimits
from engine.errors import AphroditeError, ConfigError
from engine.media import synthetic
from engine.media.video.loader import load_video
from engine.media.video.options import build_spec
from engine.paths import cache_root

SCHEMA_VERSION = 1
STANDARD_CLIP = {"width": 1920, "height": 1080, "fps": 30, "seconds": 10.0, "gop": 250,
                 "bframes": 3, "codec": "libx264"}


@dataclass
class BackendTiming:
    backend: str
    options: dict[str, Any]
    times_s: list[float] = field(default_factory=list)
    identical_to_exact: bool | None = None
    max_abs_diff: int | None = None
    mean_abs_diff: float | None = None
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None


def standard_clip() -> Path:
    """The 10 s 1080p30 H.264 clip with B-frames, generated once into the cache."""
    spec = "_".join(f"{k}{v}" for k, v in STANDARD_CLIP.items())
    path = cache_root() / "media" / f"clip_{spec}.mp4"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        params = {k: v for k, v in STANDARD_CLIP.items()}
        data = synthetic.make_video(**params)  # type: ignore[arg-type]
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


_PICT_TYPES = {1: "I", 2: "P", 3: "B", 4: "S", 5: "SI", 6: "SP", 7: "BI"}


def frame_types(data: bytes) -> dict[str, int]:
    """How many I, P and B frames the clip has (one full decode)."""
    import av

    counts: dict[str, int] = {}
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            kind = getattr(frame.pict_type, "name", None) or _PICT_TYPES.get(
                int(frame.pict_type), str(frame.pict_type))
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def time_ffmpeg_full_decode(path: Path) -> float | None:
    if shutil.which("ffmpeg") is None:
        return None
    start = time.perf_counter()
    subprocess.run(["ffmpeg", "-v", "error", "-threads", "2", "-i", str(path), "-f", "null",
                    "-"], check=True, capture_output=True)
    return time.perf_counter() - start


def run(
    clip: Path,
    backends: list[tuple[str, dict[str, Any]]],
    *,
    num_frames: int = 32,
    repeats: int = 5,
    progress=None,
) -> dict[str, Any]:
    """Time every backend and the reference; returns the result document."""
    from engine.memory import tune_allocator

    tuned = tune_allocator()
    data = clip.read_bytes()
    limits = MediaLimits.from_env()
    exact = build_spec({"backend": "pyav", "skip_nonref": False, "num_frames": num_frames},
                       "pyav", error=ConfigError)
    reference = load_video(data, exact, limits)
    timings = [BackendTiming(name, opts) for name, opts in backends]
    specs = []
    for t in timings:
        try:
            specs.append(build_spec({"backend": t.backend, "num_frames": num_frames,
                                     **t.options}, t.backend, error=ConfigError))
        except AphroditeError as err:
            specs.append(None)
            t.error = str(err)
    for t, spec in zip(timings, specs, strict=True):  # warm-up: imports, first-touch memory
        if spec is not None:
            try:
                load_video(data, spec, limits)
            except AphroditeError as err:
                t.error = str(err)
    ffmpeg_times: list[float] = []
    for repeat in range(repeats):
        if progress:
            progress(f"repeat {repeat + 1}/{repeats}")
        full = time_ffmpeg_full_decode(clip)
        if full is not None:
            ffmpeg_times.append(full)
        for t, spec in zip(timings, specs, strict=True):
            if spec is None or t.error:
                continue
            try:
                start = time.perf_counter()
                result = load_video(data, spec, limits)
                t.times_s.append(time.perf_counter() - start)
            except AphroditeError as err:
                t.error = str(err)
                continue
            if t.identical_to_exact is None:
                same_shape = result.frames.shape == reference.frames.shape
                if same_shape:
                    delta = np.abs(result.frames.astype(np.int16)
                                   - reference.frames.astype(np.int16))
                    t.max_abs_diff = int(delta.max())
                    t.mean_abs_diff = round(float(delta.mean()), 3)
                t.identical_to_exact = bool(same_shape and t.max_abs_diff == 0)
    ref_median = statistics.median(ffmpeg_times) if ffmpeg_times else None
    meta = reference.metadata
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "video-decode",
        "clip": {"path": str(clip), "bytes": len(data), "codec": meta.codec,
                 "width": meta.width, "height": meta.height, "frames": meta.total_frames,
                 "fps": meta.fps, "duration_s": meta.duration_s,
                 "frame_types": frame_types(data), "generator": STANDARD_CLIP},
        "num_frames": num_frames,
        "sampled_indices": meta.sampled_indices,
        "repeats": repeats,
        "allocator_tuned": tuned,
        "reference": {"command": "ffmpeg -threads 2 -i CLIP -f null -",
                      "times_s": ffmpeg_times, "median_s": ref_median},
        "backends": [
            {**asdict(t), "median_s": t.median_s,
             "ratio_to_full_decode": (t.median_s / ref_median
                                      if t.median_s is not None and ref_median else None)}
            for t in timings
        ],
    }
