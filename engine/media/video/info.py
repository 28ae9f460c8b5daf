"""Container facts about a video for ``aphrodite media probe``: the serving path's own scan
(the counted frame count beside the header's claim), plus the display rotation."""

from __future__ import annotations

import io
from dataclasses import dataclass

from engine.config import MediaLimits
from engine.media.video.scan import ContainerScan, scan_video


@dataclass(frozen=True)
class VideoInfo:
    container: str
    codec: str
    width: int
    height: int
    pixel_format: str | None
    header_frames: int | None
    counted_frames: int
    fps: float | None
    duration_s: float | None
    rotation: int


def probe_video(data: bytes, limits: MediaLimits, scan: ContainerScan | None = None
                ) -> VideoInfo:
    """The scan's facts (``scan``: one made already) and the rotation the first frame
    carries."""
    scan = scan or scan_video(data, limits)
    return VideoInfo(
        container=scan.container, codec=scan.codec, width=scan.width, height=scan.height,
        pixel_format=scan.pixel_format, header_frames=scan.header_frames,
        counted_frames=scan.frame_count, fps=scan.fps, duration_s=scan.duration_s,
        rotation=first_frame_rotation(data))


def first_frame_rotation(data: bytes) -> int:
    """Display rotation in degrees (counter-clockwise, as FFmpeg reports it)."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(video=0):
                return round(getattr(frame, "rotation", 0) or 0) % 360
    except av.error.FFmpegError:
        return 0
    return 0
