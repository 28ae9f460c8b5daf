"""One pass over the container's packets (no pixel decoding): the truth about a clip.

Headers lie (edit lists, variable frame rate, missing ``nb_frames``, OpenCV's estimate from
duration x fps), so the frame count is the number of video packets that will produce a shown
frame: non-empty and not marked discard (packets before an edit list's start). Their
presentation timestamps, sorted, map a frame index to a timestamp for the backends that seek.
Caps are applied here, before any frame is decoded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from engine.config import MediaLimits
from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError, sanitize


@dataclass(frozen=True)
class ContainerScan:
    """What the demuxer says about the first video stream, with the frames counted."""

    container: str
    codec: str
    width: int
    height: int
    pixel_format: str | None
    header_frames: int | None
    frame_count: int
    fps: float | None
    duration_s: float | None
    time_base: float | None
    pts: list[int] = field(repr=False, default_factory=list)
    colorspace_tagged: bool = False
    keyframe_pts: list[int] = field(repr=False, default_factory=list)
    open_gop: bool = False
    discarded: int = 0

    @property
    def has_pts(self) -> bool:
        return len(self.pts) == self.frame_count and self.frame_count > 0


def _open(data: bytes):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as exc:
        raise UnsupportedMediaError(
            f"the video could not be opened: {sanitize(exc)}",
            hint="send MP4, WebM, MKV, MOV or AVI video",
        ) from None


def scan_video(data: bytes, limits: MediaLimits) -> ContainerScan:
    """Demux every video packet once; refuse oversize or frameless clips before decoding."""
    import av

    container = _open(data)
    try:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise MediaDecodeError("the video part's file has no video stream",
                                   code="video_no_stream")
        ctx = stream.codec_context
        width, height = ctx.width or 0, ctx.height or 0
        if width * height > limits.max_video_frame_pixels:
            raise MediaTooLargeError(
                f"the video is {width}x{height}, over the {limits.max_video_frame_pixels}-pixel "
                "frame cap",
                hint="send a smaller video or raise APHRODITE_MAX_VIDEO_FRAME_PIXELS",
                code="video_too_many_pixels",
            )
        pts: list[int] = []
        keyframes: list[int] = []
        open_gop = False
        discarded = 0
        count = 0
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            if packet.is_discard:
                discarded += 1
                continue
            if packet.pts is not None:
                if packet.is_keyframe:
                    keyframes.append(packet.pts)
                elif keyframes and packet.pts < keyframes[-1]:
                    open_gop = True  # a leading picture: it references the previous GOP
            count += 1
            if count > limits.max_video_frames:
                raise MediaTooLargeError(
                    f"the video has more than {limits.max_video_frames} frames",
                    hint="send a shorter video or raise APHRODITE_MAX_VIDEO_FRAMES",
                    code="video_too_many_frames",
                )
            if packet.pts is not None:
                pts.append(packet.pts)
        if count == 0:
            raise MediaDecodeError("the video has no frames", code="video_no_frames")
        if width <= 0 or height <= 0:
            raise MediaDecodeError("the video stream has no frame size", code="video_corrupt")
        pts.sort()
        time_base = float(stream.time_base) if stream.time_base else None
        duration = None
        if len(pts) == count and time_base and count > 1:
            # Span of presentation times plus one average frame interval.
            span = (pts[-1] - pts[0]) * time_base
            duration = span * count / (count - 1)
        elif stream.duration is not None and time_base:
            duration = stream.duration * time_base
        elif container.duration is not None:
            duration = container.duration / 1e6
        fps = count / duration if duration else (
            float(stream.average_rate) if stream.average_rate else None)
        return ContainerScan(
            container=container.format.name,
            codec=ctx.codec.canonical_name,
            width=width,
            height=height,
            pixel_format=ctx.pix_fmt,
            header_frames=stream.frames or None,
            frame_count=count,
            fps=round(fps, 6) if fps else None,
            duration_s=round(duration, 6) if duration else None,
            time_base=time_base,
            pts=pts if len(pts) == count else [],
            colorspace_tagged=(ctx.colorspace or 2) != 2,  # 2 = AVCOL_SPC_UNSPECIFIED
            keyframe_pts=keyframes,
            open_gop=open_gop,
            discarded=discarded,
        )
    except av.error.FFmpegError as exc:
        raise MediaDecodeError(f"the video is corrupt: {sanitize(exc)}",
                               code="video_corrupt") from None
    finally:
        container.close()

