"""file:// media: inside the folder only, no symlinks followed, regular files only."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from engine.config import MediaPolicy, ModalityLimits
from engine.errors import MediaFetchError, MediaPolicyError, MediaTooLargeError
from engine.media.connector import MediaConnector
from tests.fixtures import synthetic


@pytest.fixture
def layout(tmp_path):
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    png = synthetic.make_image(32, 24, fmt="PNG")
    (media / "a.png").write_bytes(png)
    (media / "sub" / "b.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    return media, outside, png


async def load(media, url, limits):
    async with MediaConnector(MediaPolicy.create(allowed_local_path=media), limits) as c:
        return await c.load_bytes(url, "image")


async def test_files_inside_are_read(layout, limits):
    media, _, png = layout
    assert (await load(media, f"file://{media}/a.png", limits)).data == png
    assert (await load(media, f"file://{media}/sub/b.png", limits)).mime == "image/png"


async def test_symlinked_file_is_refused(layout, limits):
    media, outside, _ = layout
    os.symlink(outside / "secret.png", media / "link.png")
    os.symlink("/etc/passwd", media / "passwd.png")
    for name in ("link.png", "passwd.png"):
        with pytest.raises(MediaPolicyError) as info:
            await load(media, f"file://{media}/{name}", limits)
        assert info.value.code == "media_local_symlink"


async def test_symlinked_directory_is_refused(layout, limits):
    media, outside, _ = layout
    os.symlink(outside, media / "escape")
    with pytest.raises(MediaPolicyError) as info:
        await load(media, f"file://{media}/escape/secret.png", limits)
    assert info.value.code == "media_local_symlink"


async def test_fifo_is_refused_without_hanging(layout, limits):
    media, _, _ = layout
    os.mkfifo(media / "pipe.png")
    with pytest.raises(MediaPolicyError) as info:
        await load(media, f"file://{media}/pipe.png", limits)
    assert info.value.code == "media_local_not_regular"


async def test_directory_is_refused(layout, limits):
    media, _, _ = layout
    with pytest.raises(MediaPolicyError):
        await load(media, f"file://{media}/sub", limits)


async def test_missing_file_does_not_leak_the_path(layout, limits):
    media, _, _ = layout
    with pytest.raises(MediaFetchError) as info:
        await load(media, f"file://{media}/nope.png", limits)
    assert str(media) not in str(info.value) and info.value.code == "media_local_not_found"


async def test_size_cap(layout, limits):
    media, _, png = layout
    small = replace(limits, image=ModalityLimits(len(png) - 1, 1.0))
    with pytest.raises(MediaTooLargeError) as info:
        await load(media, f"file://{media}/a.png", small)
    assert "APHRODITE_MAX_IMAGE_BYTES" in info.value.hint


async def test_allowed_folder_given_through_a_symlink_still_works(layout, limits, tmp_path):
    """The operator may name the folder through a link; the check uses the real folder."""
    media, _, png = layout
    os.symlink(media, tmp_path / "media-link")
    async with MediaConnector(MediaPolicy.create(allowed_local_path=tmp_path / "media-link"),
                              limits) as c:
        assert (await c.load_bytes(f"file://{media}/a.png", "image")).data == png
