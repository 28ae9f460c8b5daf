"""Container facts about a video for ``aphrodite media probe``: the serving path's own scan
(the counted frame count beside the header's claim), plus the display rotation."""

from __future__ import annotations

import io
from typing import Any

from engine.config import MediaLimits
from engine.media.video.scan import ContainerScan, scan_video

#: the scan's facts ``media probe`` reports (the counted frames as ``counted_frames``)
REPORTED = ("container", "codec", "width", "height", "pixel_format", "header_frames")


def probe_video(data: bytes, limits: MediaLimits, scan: ContainerScan | None = None
                ) -> dict[str, Any]:
    """The scan's facts (``scan``: one made already) and the rotation the first frame
    carries."""
    scan = scan or scan_video(data, limits)
    return {**{name: getattr(scan, name) for name in REPORTED},
            "counted_frames": scan.frame_count, "fps": scan.fps, "duration_s": scan.duration_s,
            "rotation": first_frame_rotation(data)}


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
