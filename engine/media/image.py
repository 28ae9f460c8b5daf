"""Image decoding with Pillow: caps checked on the header, then RGB out.

Pillow's own decompression-bomb protection stays on; the project's pixel cap
(``APHRODITE_MAX_IMAGE_PIXELS``) is checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from engine.config import MediaLimits
from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError, sanitize

_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class ImageInfo:
    """What the header says, before decoding."""

    format: str | None
    width: int
    height: int
    mode: str
    exif_orientation: int | None
    frames: int


def _open(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaTooLargeError(
            "the image's dimensions trip the decompression-bomb guard",
            hint="send a smaller image (APHRODITE_MAX_IMAGE_PIXELS sets the pixel cap)",
            code="image_too_many_pixels",
        ) from None
    except UnidentifiedImageError:
        raise UnsupportedMediaError(
            "the image part's content is not an image format this server decodes",
            hint="send JPEG, PNG, WebP, GIF, BMP or TIFF",
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise MediaDecodeError(f"the image could not be read: {sanitize(exc)}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaDecodeError(f"the image has an empty size {width}x{height}")
    if width * height > limits.max_image_pixels:
        raise MediaTooLargeError(
            f"the image is {width}x{height} = {width * height} pixels, over the "
            f"{limits.max_image_pixels}-pixel cap",
            hint="send a smaller image or raise APHRODITE_MAX_IMAGE_PIXELS",
            code="image_too_many_pixels",
        )
    if image.format == "JPEG" and image.info.get("progressive"):
        check_jpeg_scans(data, width * height, limits.max_jpeg_scan_pixels)
    return image


def count_jpeg_scans(data: bytes, stop_after: int) -> int:
    """Start-of-scan segments in a JPEG, walked marker by marker (an APP segment's embedded
    thumbnail is skipped, entropy-coded data is jumped over by its 0xFF bytes); counting
    stops past ``stop_after``."""
    scans, i, end = 0, 2, len(data)
    while i + 4 <= end and scans <= stop_after:
        if data[i] != 0xFF:
            i = data.find(b"\xff", i)
            if i < 0:
                break
            continue
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:  # end of image
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker != 0xDA:
            continue
        scans += 1
        found = _NEXT_MARKER.search(data, i)  # entropy-coded data: skip stuffing and RSTs
        if found is None:
            return scans
        i = found.start()
    return scans


#: a marker inside entropy-coded data: 0xFF not followed by stuffing (0x00) or an RST
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")


def check_jpeg_scans(data: bytes, pixels: int, max_scan_pixels: int) -> None:
    """A progressive JPEG's decode work is its scans x pixels (each scan revisits every
    block); refuse one over the budget before decoding: a few hundred KB with thousands of
    scans took seconds of CPU."""
    allowed = max(1, max_scan_pixels // max(pixels, 1))
    scans = count_jpeg_scans(data, allowed)
    if scans > allowed:
        raise MediaTooLargeError(
            f"the progressive JPEG has more than {allowed} scans at {pixels} pixels, over the "
            f"decode budget of {max_scan_pixels} scan-pixels",
            hint="re-encode the image (a normal progressive JPEG has about 10 scans) or raise "
                 "APHRODITE_MAX_JPEG_SCAN_PIXELS", code="image_decode_too_costly")


def probe_image(data: bytes, limits: MediaLimits) -> ImageInfo:
    """Header facts for ``aphrodite media probe``; applies the same caps as decoding."""
    image = _open(data, limits)
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    except Exception:  # a broken EXIF block is ignored, as when decoding
        orientation = None
    return ImageInfo(image.format, image.width, image.height, image.mode, orientation,
                     getattr(image, "n_frames", 1))


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode to an RGB image: EXIF orientation applied, transparency composited."""
    image = _open(data, limits)
    try:
        image.load()
        with contextlib.suppress(Exception):  # broken EXIF: keep the pixels as stored
            # (only with an orientation to apply: exif_transpose copies the pixels otherwise)
            if image.getexif().get(_EXIF_ORIENTATION, 1) in range(2, 9):
                image = ImageOps.exif_transpose(image)
        return to_rgb(image, limits.image_background)
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaDecodeError(
            f"the image is truncated or corrupt: {sanitize(exc)}",
            hint="re-encode the image and send it again",
        ) from None


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """RGB with any alpha composited onto ``background``."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return image.convert("RGB")
