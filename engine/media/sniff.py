"""Content sniffing: what the bytes are, whatever the URL or header claims."""

from __future__ import annotations

import filetype

from engine.config import Modality
from engine.errors import UnsupportedMediaError

# Containers that carry audio tracks as often as video; accepted for audio parts too.
_AUDIO_CONTAINERS = {"video/mp4", "video/webm", "video/x-matroska", "video/quicktime",
                     "application/ogg", "video/ogg"}
# filetype names a few audio formats outside audio/*.
_AUDIO_ALIASES = {"application/ogg", "audio/x-wav", "audio/wav"}


def sniff_mime(data: bytes) -> str | None:
    """The MIME type the content's magic bytes say, or ``None`` when unknown."""
    kind = filetype.guess(data[:8192])
    return kind.mime if kind is not None else None


def check_kind(data: bytes, modality: Modality, declared: str | None = None) -> str | None:
    """Sniff ``data`` and refuse content of another kind than ``modality`` (HTTP 415).

    Unknown content passes (the decoder decides); the declared type is only a hint and never
    overrides what the bytes say.
    """
    mime = sniff_mime(data)
    if mime is None:
        return declared
    top = mime.split("/", 1)[0]
    ok = (
        (modality == "image" and top == "image")
        or (modality == "video" and (top == "video" or mime == "application/ogg"))
        or (modality == "audio" and (top == "audio" or mime in _AUDIO_CONTAINERS
                                     or mime in _AUDIO_ALIASES))
    )
    if not ok:
        raise UnsupportedMediaError(
            f"the {modality} part's content is {mime}, not {modality}",
            hint=f"send a {modality} file in this part, or use the part type that matches {mime}",
        )
    return mime
