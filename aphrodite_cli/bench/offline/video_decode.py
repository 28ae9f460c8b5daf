"""``aphrodite bench video-decode``: per-backend sampled-decode time on one clip.

Each repeat times, back to back on the same machine: the full-decode reference
(``ffmpeg -threads 2 -i CLIP -f null -``) and every backend decoding the same sampled frames.
Medians and the ratio to the reference median are reported (ratios, not absolute times, are
what survives a noisy shared machine), and every backend's frames are compared with an exact
full decode (PyAV without the skip path) so a fast wrong answer cannot pass.

:func:`run_video_backends`: the same short clips decoded by each backend, decode time per
backend and clip (``bench mm-processor --video-backends``).
"""

from __future__ import annotations

import contextlib
import io
import random
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aphrodite_cli.bench.harness import synthetic
from aphrodite_cli.bench.results.stats import summary
from engine.config import MediaLimits
from engine.errors import AphroditeError, ConfigError
from engine.media.video.loader import load_video
from engine.media.video.options import build_spec
from engine.media.video.sampling import DEFAULT_NUM_FRAMES
from engine.paths import cache_root

SETTLE_S = 0.25  # pause after the ffmpeg subprocess before timing anything else
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


def _compare(frames: np.ndarray, reference: np.ndarray) -> tuple[int | None, float | None]:
    """Max and mean absolute difference, frame by frame (no 400 MB temporaries)."""
    if frames.shape != reference.shape:
        return None, None
    deltas = [np.abs(a.astype(np.int16) - b.astype(np.int16))
              for a, b in zip(frames, reference, strict=True)]
    return max(int(d.max()) for d in deltas), round(float(np.mean([d.mean() for d in deltas])), 3)


def _backend_worker(conn, clip: str, video_kwargs: dict[str, Any], isolated: bool) -> None:
    """One backend in its own process, as a server runs one: warm up, then time a decode each
    time the parent asks. The first answer also compares frames with an exact decode. With
    ``isolated`` the decode runs in a decode worker process (``--decode-isolation process``)
    and the time includes handing the frames back."""
    from engine.memory import tune_allocator

    tune_allocator()
    workers = None
    try:
        data = Path(clip).read_bytes()
        limits = MediaLimits.from_env()
        spec = build_spec(video_kwargs, video_kwargs["backend"], error=ConfigError)
        if isolated:
            from engine.media.isolation import DecodeWorkers

            workers = DecodeWorkers(1, timeout_s=600)
            decode = workers.decode_video
        else:
            decode = load_video
        exact = load_video(data, build_spec({"backend": "pyav", "skip_nonref": False,
                                             "num_frames": video_kwargs["num_frames"]}, "pyav",
                                            error=ConfigError), limits).frames
        first = decode(data, spec, limits)  # warm-up: imports, first-touch memory
        diffs = _compare(first.frames, exact)
        del first, exact
        conn.send(("ready", diffs))
        while conn.recv() == "run":
            start = time.perf_counter()
            result = decode(data, spec, limits)
            conn.send(("time", time.perf_counter() - start))
            del result
    except AphroditeError as err:
        conn.send(("error", str(err)))
    finally:
        if workers is not None:
            workers.close()


def _receive(proc, conn) -> tuple[str, Any]:
    """The worker's next answer; a worker that died answers an error instead of hanging."""
    while not conn.poll(0.1):
        if not proc.is_alive():
            return "error", f"the benchmark process died (exit code {proc.exitcode})"
    return conn.recv()


def run(
    clip: Path,
    backends: list[tuple[str, dict[str, Any]]],
    *,
    num_frames: int = DEFAULT_NUM_FRAMES,
    repeats: int = 5,
    seed: int = 0,
    progress=None,
) -> dict[str, Any]:
    """Time every backend (each in its own process) and the reference; the result document."""
    import multiprocessing

    data = clip.read_bytes()
    limits = MediaLimits.from_env()
    reference = load_video(data, build_spec({"backend": "pyav", "skip_nonref": False,
                                             "num_frames": num_frames}, "pyav",
                                            error=ConfigError), limits)
    timings = [BackendTiming(name, opts) for name, opts in backends]
    ctx = multiprocessing.get_context("spawn")
    workers: list[Any] = []
    for t in timings:
        options = dict(t.options)
        isolation = str(options.pop("isolation", "thread"))
        kwargs = {"backend": t.backend, "num_frames": num_frames, **options}
        if isolation not in ("thread", "process"):
            t.error = f"isolation={isolation!r}: must be thread or process"
            workers.append(None)
            continue
        try:
            build_spec(kwargs, t.backend, error=ConfigError)
        except AphroditeError as err:
            t.error = str(err)
            workers.append(None)
            continue
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_backend_worker, args=(child, str(clip), kwargs,
                                                         isolation == "process"),
                           daemon=isolation != "process")  # a daemon may not start workers
        proc.start()
        workers.append((proc, parent))
    for t, worker in zip(timings, workers, strict=True):
        if worker is None:
            continue
        kind, payload = _receive(*worker)
        if kind == "error":
            t.error = payload
        else:
            t.max_abs_diff, t.mean_abs_diff = payload
            t.identical_to_exact = t.max_abs_diff == 0
    ffmpeg_times: list[float] = []
    # Every repeat runs the reference and each backend once, in a fresh (seeded) random order,
    # each backend in its own warm process; nothing else runs while one is timed.
    rng = random.Random(seed)
    slots: list[int | None] = [None, *range(len(timings))]
    try:
        for repeat in range(repeats):
            if progress:
                progress(f"repeat {repeat + 1}/{repeats}")
            rng.shuffle(slots)
            for slot in slots:
                if slot is None:
                    full = time_ffmpeg_full_decode(clip)
                    if full is not None:
                        ffmpeg_times.append(full)
                    time.sleep(SETTLE_S)
                    continue
                t, worker = timings[slot], workers[slot]
                if worker is None or t.error:
                    continue
                worker[1].send("run")
                kind, payload = _receive(*worker)
                if kind == "error":
                    t.error = payload
                else:
                    t.times_s.append(payload)
    finally:
        for worker in workers:
            if worker is not None:
                with contextlib.suppress(OSError, BrokenPipeError):
                    worker[1].send("stop")
                worker[0].join(timeout=10)
    ref_median = statistics.median(ffmpeg_times) if ffmpeg_times else None
    meta = reference.metadata
    return {
        "kind": "video-decode",
        "clip": {"path": str(clip), "bytes": len(data), "codec": meta.codec,
                 "width": meta.width, "height": meta.height, "frames": meta.total_frames,
                 "fps": meta.fps, "duration_s": meta.duration_s,
                 "frame_types": frame_types(data), "generator": STANDARD_CLIP},
        "num_frames": num_frames,
        "sampled_indices": meta.sampled_indices,
        "repeats": repeats,
        "order": "seeded random permutation per repeat; each backend in its own process",
        "seed": seed,
        "allocator_tuned": True,
        "reference": {"command": "ffmpeg -threads 2 -i CLIP -f null -",
                      "times_s": ffmpeg_times, "median_s": ref_median},
        "backends": [
            {**asdict(t), "median_s": t.median_s,
             "ratio_to_full_decode": (t.median_s / ref_median
                                      if t.median_s is not None and ref_median else None)}
            for t in timings
        ],
    }


def run_video_backends(backends: list[dict[str, Any]], *, clips: int = 3, width: int = 640,
                       height: int = 360, seconds: float = 2.0, gop: int = 30,
                       num_frames: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """The same videos decoded by each backend (a ``video`` kwargs dict: backend and its
    options): decode time per backend and clip."""
    limits = MediaLimits.from_env()
    videos = [synthetic.make_video(width=width, height=height, seconds=seconds, gop=gop,
                                   seed=seed + i) for i in range(clips)]
    rows = []
    for choice in backends:
        backend = choice["backend"]
        spec = build_spec({"num_frames": num_frames, **choice}, backend, error=ConfigError)
        times, error = [], None
        try:
            load_video(videos[0], spec, limits)  # warm-up: imports
            for data in videos:
                times.append(load_video(data, spec, limits).metadata.decode_s)
        except AphroditeError as err:
            error = str(err)
        rows.append({"backend": backend, "options": {k: v for k, v in choice.items()
                                                      if k != "backend"},
                     "clip": f"h264 {width}x{height} gop {gop} "
                     f"{int(seconds * 30)} frames", "frames_sampled": num_frames,
                     "clips": clips, "decode_ms": summary([t * 1e3 for t in times]),
                     "error": error})
    return rows
