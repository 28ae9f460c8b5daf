"""Load a video: scan, sample, decode with the chosen backend, check what came back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from engine.config import MediaLimits
from engine.errors import MediaDecodeError, MediaTooLargeError
from engine.media.decode_errors import as_decode_error
from engine.media.pool import decode_executor
from engine.media.video.backend_info import BACKENDS
from engine.media.video.options import VideoLoadSpec
from engine.media.video.registry import get_backend
from engine.media.video.sampling import sample_indices
from engine.media.video.scan import ContainerScan, scan_video


@dataclass(frozen=True)
class VideoMetadata:
    """What a caller learns with the frames."""

    backend: str
    total_frames: int
    header_frames: int | None
    fps: float | None
    duration_s: float | None
    sampled_indices: list[int]
    width: int
    height: int
    codec: str
    container: str
    scan_s: float
    decode_s: float


@dataclass(frozen=True)
class VideoFrames:
    """``frames``: (T, H, W, 3) uint8 RGB as displayed; ``metadata``: see above."""

    frames: np.ndarray
    metadata: VideoMetadata

    @property
    def nbytes(self) -> int:
        return int(self.frames.nbytes)


def decoded_bytes(scan: ContainerScan, indices: list[int]) -> int:
    """RGB bytes the sampled frames take (what a GPU budget reserves)."""
    return len(indices) * scan.width * scan.height * 3


def plan(data: bytes, spec: VideoLoadSpec, limits: MediaLimits) -> tuple[ContainerScan, list[int]]:
    """Scan and sample; refuses outputs over the decoded-bytes cap before decoding."""
    scan = scan_video(data, limits)
    return scan, plan_scanned(scan, spec, limits)


def plan_scanned(scan: ContainerScan, spec: VideoLoadSpec, limits: MediaLimits) -> list[int]:
    """The frames to decode from a clip already scanned (its sampling, under the cap)."""
    indices = sample_indices(scan.frame_count, scan.fps, spec.sampling)
    need = decoded_bytes(scan, indices)
    if need > limits.max_video_decoded_bytes:
        raise MediaTooLargeError(
            f"{len(indices)} frames of {scan.width}x{scan.height} would take {need} bytes, over "
            f"the {limits.max_video_decoded_bytes}-byte cap",
            hint="ask for fewer frames (num_frames) or raise APHRODITE_MAX_VIDEO_DECODED_BYTES",
            code="video_too_large_decoded",
        )
    return indices


def decode_planned(data: bytes, spec: VideoLoadSpec, scan: ContainerScan, indices: list[int],
                   scan_s: float = 0.0) -> VideoFrames:
    backend = get_backend(spec.backend)
    start = time.perf_counter()
    frames = backend.decode(data, scan, indices, spec.options)
    decode_s = time.perf_counter() - start
    if frames.shape[0] != len(indices):
        raise MediaDecodeError(
            f"the video is truncated or corrupt: {frames.shape[0]} of {len(indices)} sampled "
            "frames could be decoded", hint="re-encode the video and send it again",
            code="video_truncated")
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise MediaDecodeError(f"the {spec.backend} backend returned frames of shape "
                               f"{frames.shape}", code="video_corrupt")
    meta = VideoMetadata(
        backend=spec.backend, total_frames=scan.frame_count, header_frames=scan.header_frames,
        fps=scan.fps, duration_s=scan.duration_s, sampled_indices=list(indices),
        width=int(frames.shape[2]), height=int(frames.shape[1]), codec=scan.codec,
        container=scan.container, scan_s=round(scan_s, 6), decode_s=round(decode_s, 6))
    return VideoFrames(frames, meta)


def load_video(data: bytes, spec: VideoLoadSpec, limits: MediaLimits) -> VideoFrames:
    """Scan, sample and decode ``data`` with ``spec.backend`` (blocking)."""
    start = time.perf_counter()
    scan, indices = plan(data, spec, limits)
    return decode_planned(data, spec, scan, indices, time.perf_counter() - start)


async def load_video_async(data: bytes, spec: VideoLoadSpec, limits: MediaLimits,
                           budget=None) -> VideoFrames:
    """:func:`load_video` on the decode pool; GPU backends hold ``budget`` while decoding.
    Any decoder exception is the item's client error (as from a decode worker)."""
    try:
        return await _load_video_async(data, spec, limits, budget)
    except Exception as exc:
        raise as_decode_error("video", exc) from None


async def _load_video_async(data: bytes, spec: VideoLoadSpec, limits: MediaLimits,
                            budget) -> VideoFrames:
    loop = asyncio.get_running_loop()
    pool = decode_executor()
    start = time.perf_counter()
    scan, indices = await loop.run_in_executor(pool, plan, data, spec, limits)
    scan_s = time.perf_counter() - start
    if budget is not None and BACKENDS[spec.backend].gpu:
        async with budget.reserve(decoded_bytes(scan, indices)):
            return await loop.run_in_executor(pool, decode_planned, data, spec, scan, indices,
                                              scan_s)
    return await loop.run_in_executor(pool, decode_planned, data, spec, scan, indices, scan_s)
