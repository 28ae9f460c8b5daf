"""The interface every video backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from engine.errors import MediaDecodeError
from engine.media import decode_deadline, frame_memory
from engine.media.video.backend_info import BACKENDS
from engine.media.video.options import BackendOptions
from engine.media.video.scan import ContainerScan


class VideoBackend(ABC):
    """Decode the frames at given presentation-order indices.

    Returns ``(T, H, W, 3)`` uint8 RGB, in the order of ``indices``, as displayed (the
    container's rotation applied, as the ffmpeg CLI does). May return fewer frames than asked
    when the stream ends early (truncated input); the loader turns that into an error.
    """

    name: ClassVar[str]

    @property
    def gpu(self) -> bool:
        """Decodes on the GPU (from the backend's record in ``backend_info``)."""
        return BACKENDS[self.name].gpu

    @abstractmethod
    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: BackendOptions) -> np.ndarray: ...


def check_frame_size(width: int, height: int, scan: ContainerScan) -> None:
    """Every decoded frame must have the stream's declared size: the caps were checked on
    that size, and a stream that switches to a bigger one mid-way would otherwise decode
    past them (and frames of two sizes do not stack). Checked before the frame is
    converted or kept; and, in the API server's own threads, the decode's time budget."""
    decode_deadline.check()
    if (width, height) != (scan.width, scan.height):
        raise MediaDecodeError(
            f"a decoded frame is {width}x{height}, the stream declared {scan.width}x"
            f"{scan.height}: frames that change size mid-stream are refused",
            hint="re-encode the video at one frame size", code="video_frame_size_changed")


def rotate_for_display(frame: np.ndarray, rotation: float | int | None) -> np.ndarray:
    """Apply FFmpeg's display rotation (degrees counter-clockwise) to an (H, W, 3) frame."""
    turns = round((rotation or 0) / 90.0) % 4
    return np.ascontiguousarray(np.rot90(frame, k=turns)) if turns else frame


def stack(frames: list[np.ndarray], scan: ContainerScan) -> np.ndarray:
    """One (T, H, W, 3) array in this process's media memory (see ``frame_memory``)."""
    if not frames:
        return np.empty((0, scan.height, scan.width, 3), dtype=np.uint8)
    out = frame_memory.empty((len(frames), *frames[0].shape), frames[0].dtype)
    return np.stack(frames, out=out)
