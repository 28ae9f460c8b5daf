"""Synthetic media that looks like real media to codecs: structure and motion, not noise.

Used by the tests, the demo and (later) the benchmark datasets. Everything is deterministic
for a given seed, and every video frame is distinct (a moving bar and a frame counter band),
so a decoder that returns the wrong frame is caught.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image


def image_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """An RGB uint8 array with gradients, blocks and a seed-dependent tint."""
    rng = np.random.default_rng(seed)
    # a row of x and a column of y, broadcast (not two full grids: a 1080p frame in 10 ms
    # instead of 90)
    y, x = np.arange(height)[:, None], np.arange(width)[None, :]
    tint = rng.integers(0, 256, size=3)
    arr = np.empty((height, width, 3), dtype=np.uint8)
    arr[..., 0] = (x * 255 // max(width - 1, 1) + tint[0]) % 256
    arr[..., 1] = (y * 255 // max(height - 1, 1) + tint[1]) % 256
    arr[..., 2] = (((x // 16) + (y // 16)) % 2 * 128 + tint[2]) % 256
    return arr


def make_image(
    width: int = 640, height: int = 480, *, fmt: str = "JPEG", seed: int = 0,
    quality: int = 90, mode: str = "RGB",
) -> bytes:
    """Encoded image bytes (JPEG, PNG, WEBP, GIF, BMP, TIFF)."""
    image = Image.fromarray(image_array(width, height, seed))
    if mode != "RGB":
        image = image.convert(mode)
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt.upper() in ("JPEG", "WEBP") else {}
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def video_frame(index: int, width: int, height: int, seed: int = 0,
                base: np.ndarray | None = None) -> np.ndarray:
    """Frame ``index``: a textured background, a bar moving with time and the index in bits.
    ``base``: ``image_array(width, height, seed)``, when the caller made it already."""
    if base is None:
        base = image_array(width, height, seed)
    frame = np.roll(base, shift=(index * 3) % max(width, 1), axis=1)
    bar_x = (index * 7) % max(width - 8, 1)
    frame[:, bar_x:bar_x + 8] = 255 - frame[:, bar_x:bar_x + 8]
    band = max(height // 8, 2)
    for bit in range(16):  # the frame number, as 16 black/white cells across the top band
        x0, x1 = bit * width // 16, (bit + 1) * width // 16
        frame[:band, x0:x1] = 255 if (index >> bit) & 1 else 0
    return frame


def read_frame_index(frame: np.ndarray) -> int:
    """The frame number :func:`video_frame` wrote into the top band (frames as displayed
    unrotated)."""
    height, width = frame.shape[:2]
    row = max(height // 8, 2) // 2
    index = 0
    for bit in range(16):
        x = (bit * width // 16 + (bit + 1) * width // 16) // 2
        if frame[row, x].mean() > 127:
            index |= 1 << bit
    return index


def make_video(
    *, width: int = 320, height: int = 240, fps: int = 30, seconds: float = 2.0,
    codec: str = "libx264", container: str = "mp4", gop: int = 30, bframes: int = 2,
    pix_fmt: str = "yuv420p", seed: int = 0, crf: int = 23, rotation: int = 0,
    frame_times: list[float] | None = None, x264_params: str = "",
) -> bytes:
    """An encoded clip whose every frame differs (see :func:`video_frame`).

    ``rotation`` writes a display rotation (degrees) into the container; ``frame_times``
    (seconds, increasing) makes a variable-frame-rate clip with those presentation times.
    """
    import av

    buf = io.BytesIO()
    out = av.open(buf, mode="w", format=container)
    stream = out.add_stream(codec, rate=Fraction(fps))
    stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
    if rotation:
        stream.set_display_rotation(rotation)
    time_base = Fraction(1, 90_000)
    if frame_times is not None:
        stream.time_base = time_base
        stream.codec_context.time_base = time_base
    options = {"g": str(gop)}
    if codec in ("libx264", "libx265"):
        options.update({"bf": str(bframes), "crf": str(crf), "preset": "ultrafast"
                        if bframes == 0 else "veryfast"})
        if codec == "libx264":
            # b-adapt=0: exactly `bframes` B-frames per group, whatever the content.
            params = [p for p in ("b-adapt=0" if bframes else "", x264_params) if p]
            if params:
                options["x264-params"] = ":".join(params)
        if codec == "libx265":
            options["x265-params"] = f"log-level=error:bframes={bframes}:b-adapt=0"
    stream.codec_context.options = options
    # Frame-threaded encoding: one slice per frame, as most files in the wild have (sliced
    # threads would make every frame decodable in parallel slices, which real clips rarely are).
    stream.codec_context.thread_type = "FRAME"
    count = len(frame_times) if frame_times is not None else round(fps * seconds)

    base = image_array(width, height, seed)

    def frames():
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(video_frame(i, width, height, seed, base),
                                               format="rgb24")
            if frame_times is not None:
                frame.pts, frame.time_base = round(frame_times[i] / time_base), time_base
            yield frame

    return _encode(out, stream, frames(), buf)


def _encode(out: Any, stream: Any, frames: Any, buf: io.BytesIO) -> bytes:
    """Encode ``frames`` into ``stream``, flush the encoder, close ``out``: the file's bytes.
    The calling thread keeps its scheduling policy (see :func:`keep_scheduling`)."""
    with keep_scheduling():
        for frame in frames:
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
        out.close()
    return buf.getvalue()


@contextlib.contextmanager
def keep_scheduling() -> Iterator[None]:
    """Put the calling thread's scheduling policy and priority back on the way out.

    SVT-AV1 (``libsvtav1``), when it may (as root), moves the thread that opens the encoder
    to real-time ``SCHED_FIFO`` priority 99 and leaves it there. Every process started from
    that thread afterwards inherits it: a server launched by the benchmark (or a test) ran
    its engine, API server and their threads at FIFO 99, where a thread that does not block
    is never preempted by its peers, so a decoding engine starved its own API server
    (``/metrics`` unanswered for seconds while the engine decoded)."""
    try:
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    except (AttributeError, OSError):  # not Linux: nothing to keep
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
                os.sched_setscheduler(0, policy, param)


def make_audio(
    *, seconds: float = 1.0, rate: int = 22_050, channels: int = 2, fmt: str = "wav",
    freq: float = 440.0,
) -> bytes:
    """A tone sweep, encoded as WAV (PCM), FLAC, MP3 or OGG/Opus."""
    import av

    codec = {"wav": "pcm_s16le", "flac": "flac", "mp3": "libmp3lame", "ogg": "libopus"}[fmt]
    out_rate = 48_000 if fmt == "ogg" else rate
    n = int(seconds * out_rate)
    t = np.arange(n) / out_rate
    tone = 0.4 * np.sin(2 * np.pi * (freq + 200 * t / max(seconds, 1e-9)) * t)
    pcm = (np.repeat(tone[None, :], channels, axis=0) * 32767).astype(np.int16)
    layout = "stereo" if channels == 2 else "mono"
    buf = io.BytesIO()
    out = av.open(buf, mode="w", format=fmt)
    stream = out.add_stream(codec, rate=out_rate, layout=layout)
    frame_size = stream.codec_context.frame_size or 1024

    def frames():
        for start in range(0, n, frame_size):
            chunk = np.ascontiguousarray(pcm[:, start:start + frame_size].T.reshape(1, -1))
            frame = av.AudioFrame.from_ndarray(chunk, format="s16", layout=layout)
            frame.rate = out_rate
            frame.pts = start
            yield frame

    return _encode(out, stream, frames(), buf)
