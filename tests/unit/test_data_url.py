"""data: URLs: base64 only, content sniffed, malformed base64 is a 400."""

from __future__ import annotations

import base64

import pytest

from engine.config import MediaPolicy
from engine.errors import InvalidRequestError, UnsupportedMediaError
from engine.media.connector import MediaConnector
from tests.fixtures import synthetic


def data_url(mime: str, data: bytes, urlsafe: bool = False) -> str:
    enc = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    return f"data:{mime};base64,{enc(data).decode()}"


async def load(url: str, modality, limits):
    async with MediaConnector(MediaPolicy.create(), limits) as c:
        return await c.load_bytes(url, modality)


async def test_image_data_url(limits):
    png = synthetic.make_image(16, 16, fmt="PNG")
    media = await load(data_url("image/png", png), "image", limits)
    assert media.data == png and media.mime == "image/png" and media.source == "data"


async def test_urlsafe_and_unpadded_base64_accepted(limits):
    jpeg = synthetic.make_image(17, 13, fmt="JPEG")
    url = data_url("image/jpeg", jpeg, urlsafe=True).rstrip("=")
    assert (await load(url, "image", limits)).data == jpeg


@pytest.mark.parametrize("payload", ["!!!!", "ab=c", "a" * 5, "QUJD\x00"])
async def test_broken_base64_is_400(limits, payload):
    with pytest.raises(InvalidRequestError) as info:
        await load(f"data:image/png;base64,{payload}", "image", limits)
    assert info.value.status == 400 and info.value.code == "media_data_url_malformed"


async def test_declared_mime_does_not_override_content(limits):
    jpeg = synthetic.make_image(16, 16, fmt="JPEG")
    media = await load(data_url("image/png", jpeg), "image", limits)
    assert media.mime == "image/jpeg" and media.declared_mime == "image/png"


async def test_audio_in_an_image_part_is_unsupported_media(limits):
    wav = synthetic.make_audio(seconds=0.1)
    with pytest.raises(UnsupportedMediaError) as info:
        await load(data_url("image/png", wav), "image", limits)
    assert (info.value.status, info.value.code) == (400, "unsupported_media_type")


async def test_audio_data_url_for_audio(limits):
    wav = synthetic.make_audio(seconds=0.1)
    assert (await load(data_url("audio/wav", wav), "audio", limits)).size == len(wav)
