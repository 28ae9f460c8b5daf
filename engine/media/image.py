"""Image decoding with Pillow: caps checked on the header, then RGB out.

Pillow's own decompression-bomb protection stays on; the project's pixel cap
(``APHRODITE_MAX_IMAGE_PIXELS``) is checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import contextlib
import io
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
    return image


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
