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
    """The MIME type the content's magic bytes say, or ``None`` when unknown.

    Text (HTML error pages, JSON) has no magic bytes; it is recognised as text when the head
    decodes as UTF-8 without control characters.
    """
    kind = filetype.guess(data[:8192])
    if kind is not None:
        return kind.mime
    head = data[:1024].lstrip()
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # binary, unless only the cut-off last character broke
        text = head[: exc.start].decode("utf-8") if exc.start >= len(head) - 3 else ""
    if text and all(ch.isprintable() or ch in "\r\n\t" for ch in text):
        if text[:1] == "<":
            return "text/html"
        return "application/json" if text[:1] in "{[" else "text/plain"
    return None


def check_kind(data: bytes, modality: Modality) -> str | None:
    """Sniff ``data`` and refuse content of another kind than ``modality`` (HTTP 400,
    ``unsupported_media_type``).

    Returns the sniffed type; unknown content passes (``None``: the decoder decides). A
    declared type (header, data URL) is never consulted: the bytes decide.
    """
    mime = sniff_mime(data)
    if mime is None:
        return None
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
            hint=f"send {'an' if modality[0] in 'aeiou' else 'a'} {modality} file in this part, "
                 f"or use the part type that matches {mime}",
        )
    return mime
