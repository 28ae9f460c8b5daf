"""The largest synthetic media a command makes, checked before a byte is made: a size from a
flag (``--bucket-config``, ``--archetypes``, ``media generate --width``) or a trace row is
otherwise an array of width x height x 3 bytes per frame that a typo (or a hostile trace)
makes terabytes long. An error names the flag (or the file and row) and the cap."""

from __future__ import annotations

from engine.errors import ConfigError

#: the longest side of an image or a video frame, in pixels (8K is 7680)
MAX_SIDE = 8192
#: the most frames in one synthetic video
MAX_FRAMES = 3600
#: the most pixels in one synthetic video, all frames together (a minute of 1080p at 30 fps)
MAX_VIDEO_PIXELS = 1920 * 1080 * 1800
#: the highest synthetic video frame rate
MAX_FPS = 240
#: the longest synthetic video or audio, in seconds
MAX_SECONDS = 600.0


def _refuse(where: str, what: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{where}: {what}", hint=hint, code="media_too_large")


def check_size(where: str, width: int, height: int, frames: int = 1) -> None:
    """Refuse a synthetic image (``frames`` 1) or video past the caps; ``where`` names the
    flag or the row."""
    if max(width, height) > MAX_SIDE:
        raise _refuse(where, f"{width}x{height} is past the {MAX_SIDE}-pixel side cap")
    if frames > MAX_FRAMES:
        raise _refuse(where, f"{frames} frames is past the {MAX_FRAMES}-frame cap")
    if frames > 1 and width * height * frames > MAX_VIDEO_PIXELS:
        raise _refuse(where, f"{width}x{height} x {frames} frames is past the cap of "
                             f"{MAX_VIDEO_PIXELS} pixels per video (a minute of 1080p30)")


def check_seconds(where: str, seconds: float, fps: int | None = None) -> None:
    """Refuse a synthetic video or audio longer than :data:`MAX_SECONDS` (or a video of more
    than :data:`MAX_FRAMES` frames at ``fps``)."""
    if not seconds <= MAX_SECONDS:
        raise _refuse(where, f"{seconds:g} s is past the {MAX_SECONDS:g}-second cap")
    if fps is not None and seconds * fps > MAX_FRAMES:
        raise _refuse(where, f"{seconds:g} s at {fps} fps is {seconds * fps:g} frames, past "
                             f"the {MAX_FRAMES}-frame cap", hint="lower --seconds or --fps")
