"""Hostile media made on this machine, deterministic: files that make decoders fail or work
hard in the ways the server's decode defences are for. The hostile catalogue
(``aphrodite_cli/bench/load/hostile.py``, so `bench soak`) sends them, and the tests take
them from ``tests/fixtures.py``.

- :func:`dds_with_unknown_pixel_format`: Pillow raises ``NotImplementedError`` on it;
- :func:`foreign_failure`: a valid file with a few bytes changed (a seeded search) until its
  decoder raises something other than the project's own errors;
- :func:`resolution_switch_ts`: two MPEG-TS clips joined, the second 100x the pixels of the
  first (the container declares the first size);
- :func:`many_scan_jpeg`: a flat progressive JPEG whose small scan is repeated thousands of
  times (a few tens of KB, seconds of CPU to decode).
"""

from __future__ import annotations

import io
import random
import struct
from collections.abc import Callable

from aphrodite_cli.bench.harness import synthetic


def dds_with_unknown_pixel_format() -> bytes:
    """A DDS header whose pixel-format flags Pillow does not implement, and 64 bytes."""
    header = bytearray(128)
    header[0:4] = b"DDS "
    struct.pack_into("<IIII", header, 4, 124, 0x1007, 4, 4)  # size, flags, height, width
    struct.pack_into("<II", header, 76, 32, 0x80000)  # pixel format: size, unknown flags
    return bytes(header) + bytes(64)


#: the media_io_kwargs a foreign-failure video is searched with, and must be sent with: one
#: decoding thread, since FFmpeg's frame threads may drop a corrupt frame (a truncated clip)
#: or raise, by timing, where one thread always does the same; four frames sampled.
FOREIGN_VIDEO_IO = {"backend": "pyav", "threads": 1, "num_frames": 4}


def foreign_failure(base: bytes, decode: Callable[[bytes], object], seed: int,
                    tries: int = 600, repeats: int = 3) -> tuple[bytes, str]:
    """``base`` with 1-20 bytes replaced per try (``random.Random(seed)``) until ``decode``
    raises an exception that is not one of the project's (an ``AphroditeError``), of the same
    type ``repeats`` times running: the first hit and its exception's type name.
    ``LookupError`` when ``tries`` find none."""
    rng = random.Random(seed)
    for _ in range(tries):
        data = bytearray(base)
        for _ in range(rng.randint(1, 20)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        raised = {_foreign_raised(decode, bytes(data)) for _ in range(repeats)}
        if len(raised) == 1 and None not in raised:
            return bytes(data), raised.pop()
    raise LookupError(f"no mutation in {tries} tries made the decoder raise a foreign "
                      "exception")


def _foreign_raised(decode: Callable[[bytes], object], data: bytes) -> str | None:
    """The type name of the foreign exception ``decode(data)`` raises, else None."""
    from engine.errors import AphroditeError

    try:
        decode(data)
    except AphroditeError:
        return None
    except Exception as exc:
        return type(exc).__name__
    return None


def foreign_failure_video(seed: int = 1) -> tuple[bytes, str]:
    """A 1 s 64x48 MP4, mutated (:func:`foreign_failure`) until ``load_video`` with
    :data:`FOREIGN_VIDEO_IO` raises a foreign exception."""
    from engine.config import MediaLimits
    from engine.errors import ConfigError
    from engine.media.video import load_video
    from engine.media.video.options import build_spec

    spec = build_spec(dict(FOREIGN_VIDEO_IO), FOREIGN_VIDEO_IO["backend"], error=ConfigError)
    limits = MediaLimits.from_env()
    video = synthetic.make_video(width=64, height=48, seconds=1)
    return foreign_failure(video, lambda d: load_video(d, spec, limits), seed=seed)


def resolution_switch_ts() -> bytes:
    """MPEG-TS: 1 s at 64x48 followed by 1 s at 640x480 (the scan sees the first size)."""
    small = synthetic.make_video(width=64, height=48, seconds=1, container="mpegts")
    big = synthetic.make_video(width=640, height=480, seconds=1, container="mpegts", seed=1)
    return small + big


def jpeg_scans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each start-of-scan segment of a JPEG, with its entropy-coded data."""
    out, i = [], 2
    while i < len(data) - 1 and data[i + 1] != 0xD9:
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        end = i + 2 + length
        if data[i + 1] == 0xDA:
            while True:
                end = data.index(b"\xff", end)
                if data[end + 1] == 0 or 0xD0 <= data[end + 1] <= 0xD7:
                    end += 2
                    continue
                break
            out.append((i, end))
        i = end
    return out


def many_scan_jpeg(side: int, repeats: int) -> bytes:
    """A flat ``side`` x ``side`` progressive JPEG whose small luma AC scan is repeated
    ``repeats`` times: every repeat makes the decoder walk all of the image's blocks again
    (``many_scan_jpeg(2000, 3000)`` is ~66 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 200)).save(buf, "JPEG", progressive=True)
    data = buf.getvalue()
    start, end = max((s for s in jpeg_scans(data) if s[1] - s[0] < 100),
                     key=lambda s: s[1] - s[0])
    eoi = data.rindex(b"\xff\xd9")
    return data[:eoi] + data[start:end] * repeats + data[eoi:]
