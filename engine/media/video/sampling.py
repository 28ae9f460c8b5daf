"""The frame sampler shared by every backend.

Indices are chosen over the *counted* frame count (see :mod:`engine.media.video.scan`), never
over a header's claim, so every backend samples the same frames of the same clip:

- ``max_duration`` (seconds) first limits the clip to its first ``max_duration`` seconds;
- ``fps`` (frames per second wanted) sets the count to ``ceil(duration * fps)``, at most
  ``num_frames``;
- otherwise the count is ``num_frames`` (default 32), at most the frames available;
- the indices are spread uniformly, rounding half up:
  ``floor(linspace(0, n_available - 1, count) + 0.5)``, deduplicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError

DEFAULT_NUM_FRAMES = 32
MAX_NUM_FRAMES = 1024


@dataclass(frozen=True)
class SamplingRequest:
    """Which frames a request wants."""

    num_frames: int = DEFAULT_NUM_FRAMES
    fps: float | None = None
    max_duration: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_frames, int) or isinstance(self.num_frames, bool) or not (
            1 <= self.num_frames <= MAX_NUM_FRAMES
        ):
            raise InvalidRequestError(
                f"num_frames={self.num_frames!r} must be an integer from 1 to {MAX_NUM_FRAMES}",
                hint='set "num_frames" in media_io_kwargs.video',
                code="invalid_video_sampling", param="media_io_kwargs",
            )
        for name in ("fps", "max_duration"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float) or not math.isfinite(value) or value <= 0):
                raise InvalidRequestError(
                    f"{name}={value!r} must be a positive number",
                    hint=f'set "{name}" in media_io_kwargs.video or leave it out',
                    code="invalid_video_sampling", param="media_io_kwargs",
                )


def sample_indices(total_frames: int, native_fps: float | None, request: SamplingRequest
                   ) -> list[int]:
    """The presentation-order indices to decode, ascending and unique."""
    if total_frames <= 0:
        return []
    available = total_frames
    if request.max_duration is not None and native_fps:
        available = max(1, min(total_frames, math.floor(request.max_duration * native_fps)))
    count = min(request.num_frames, available)
    if request.fps is not None and native_fps:
        duration = available / native_fps
        count = max(1, min(count, math.ceil(duration * request.fps - 1e-9)))
    if count == 1:
        return [0]
    step = (available - 1) / (count - 1)
    return sorted({int(i * step + 0.5) for i in range(count)})
