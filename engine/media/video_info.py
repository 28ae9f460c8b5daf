"""Container facts about a video, read with PyAV without decoding pixels.

The frame count is counted from the packets (headers lie: edit lists, VFR, missing
``nb_frames``), and reported beside what the header claims.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from engine.errors import MediaDecodeError, UnsupportedMediaError, sanitize


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


def probe_video(data: bytes) -> VideoInfo:
    """Header facts and the true packet count of the first video stream."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as exc:
        raise UnsupportedMediaError(
            f"the video could not be opened: {sanitize(exc)}",
            hint="send MP4, WebM, MKV, MOV or AVI video",
        ) from None
    try:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise MediaDecodeError("the video part's file has no video stream")
        ctx = stream.codec_context
        counted = sum(1 for p in container.demux(stream) if p.size > 0)
        rate = stream.average_rate or stream.guessed_rate
        duration = None
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / 1e6
        rotation = 0
        try:
            side = getattr(stream, "side_data", None)
            rotation = round(side.get("DISPLAYMATRIX", 0)) if side else 0
        except Exception:
            rotation = 0
        return VideoInfo(
            container=container.format.name,
            codec=ctx.name,
            width=ctx.width,
            height=ctx.height,
            pixel_format=ctx.pix_fmt,
            header_frames=stream.frames or None,
            counted_frames=counted,
            fps=float(rate) if rate else None,
            duration_s=round(duration, 4) if duration is not None else None,
            rotation=rotation,
        )
    except av.error.FFmpegError as exc:
        raise MediaDecodeError(f"the video is corrupt: {sanitize(exc)}") from None
    finally:
        container.close()
