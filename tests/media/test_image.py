"""Image decoding: RGB out, EXIF orientation, transparency, caps before decoding, bad input."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from engine.media.image import decode_image, probe_image
from tests.fixtures import synthetic


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims huge dimensions but carries almost no data (a bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats_decode_to_rgb(fmt, limits):
    image = decode_image(synthetic.make_image(40, 30, fmt=fmt), limits)
    assert image.mode == "RGB" and image.size == (40, 30)


def test_rgba_is_composited_onto_the_background(limits):
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((0, 0), (0, 0, 255, 255))          # one opaque blue pixel
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    out = decode_image(buf.getvalue(), limits)
    assert out.getpixel((1, 1)) == (255, 255, 255) and out.getpixel((0, 0)) == (0, 0, 255)
    black = decode_image(buf.getvalue(), replace(limits, image_background=(0, 0, 0)))
    assert black.getpixel((1, 1)) == (0, 0, 0)


def test_palette_transparency_and_grayscale(limits):
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([10, 20, 30] * 256)
    pal.info["transparency"] = 0
    buf = io.BytesIO()
    pal.save(buf, format="PNG", transparency=0)
    assert decode_image(buf.getvalue(), limits).getpixel((0, 0)) == (255, 255, 255)
    gray16 = Image.fromarray(np.full((3, 5), 40000, dtype=np.uint16))
    buf = io.BytesIO()
    gray16.save(buf, format="PNG")
    assert decode_image(buf.getvalue(), limits).mode == "RGB"


def test_exif_orientation_is_applied(limits):
    base = Image.fromarray(synthetic.image_array(60, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    base.save(buf, format="JPEG", exif=exif)
    assert probe_image(buf.getvalue(), limits).exif_orientation == 6
    assert decode_image(buf.getvalue(), limits).size == (20, 60)


def test_one_by_one_image(limits):
    assert decode_image(synthetic.make_image(1, 1, fmt="PNG"), limits).size == (1, 1)


def test_pixel_cap_checked_from_the_header_before_decoding(limits, monkeypatch):
    """The refusal comes from the header alone: the pixel data (900 MP, 2.7 GB as RGB) is
    never loaded or converted; any attempt to would fail this test."""
    from PIL import Image

    def never(self, *args, **kwargs):
        raise AssertionError("the pixel data of an over-cap image was decoded")

    monkeypatch.setattr(Image.Image, "load", never)
    monkeypatch.setattr(Image.Image, "convert", never)
    bomb = png_header_only(30_000, 30_000)
    with pytest.raises(MediaTooLargeError) as info:
        decode_image(bomb, replace(limits, max_image_pixels=10_000_000))
    assert info.value.status == 413 and "APHRODITE_MAX_IMAGE_PIXELS" in info.value.hint


def test_pillow_bomb_guard_stays_on_even_with_a_huge_cap(limits):
    with pytest.raises(MediaTooLargeError) as info:
        decode_image(png_header_only(60_000, 60_000), replace(limits, max_image_pixels=10**12))
    assert "decompression-bomb" in info.value.message


def test_truncated_image_is_422(limits):
    jpeg = synthetic.make_image(200, 200, fmt="JPEG")
    with pytest.raises(MediaDecodeError) as info:
        decode_image(jpeg[: len(jpeg) // 2], limits)
    assert info.value.status == 422


def test_corrupt_pixel_data_is_422(limits):
    png = bytearray(synthetic.make_image(50, 50, fmt="PNG"))
    png[60:200] = bytes(140)
    with pytest.raises(MediaDecodeError):
        decode_image(bytes(png), limits)


def test_not_an_image_is_unsupported_media(limits):
    with pytest.raises(UnsupportedMediaError) as info:
        decode_image(b"definitely not an image" * 10, limits)
    assert info.value.status == 400


def test_zero_height_image_is_refused(limits):
    with pytest.raises((MediaDecodeError, UnsupportedMediaError)):
        decode_image(png_header_only(10, 0), limits)


def test_error_messages_carry_no_paths_or_addresses(limits):
    try:
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, limits)
    except (MediaDecodeError, UnsupportedMediaError) as err:
        text = str(err)
        assert "0x" not in text and "/usr" not in text and "Traceback" not in text
    else:
        pytest.fail("a broken PNG decoded")
