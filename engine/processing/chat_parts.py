"""OpenAI chat messages -> template messages + the media they reference (no fetching).

Accepted content parts: ``text``; ``image_url`` ({url, detail}); ``video_url``; ``audio_url``;
``input_audio`` ({data: base64, format}). A string content is text. Anything else is a 400
naming the part.

A media part may carry vLLM's ``uuid`` (a client's name for the item, see
:mod:`engine.processing.media_uuids`): beside its media it names that content; with the media
left out (``"image_url": null``, or the key missing) it refers to content sent before under
that uuid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.processing.tool_messages import tool_fields

_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac",
                  "ogg": "audio/ogg", "m4a": "audio/mp4", "webm": "audio/webm"}
_ROLES = {"system", "user", "assistant", "developer", "tool"}
_MEDIA_KEYS = (*_URL_PARTS, "input_audio")
#: the longest media ``uuid`` accepted, in characters
MAX_UUID_CHARS = 256


@dataclass(frozen=True)
class MediaRef:
    """One media part: its modality, its URL (None: left out, named by ``uuid`` alone), the
    client's ``uuid`` if any, and where it is (``messages[n].content[k]``, for errors)."""

    modality: str
    url: str | None
    uuid: str | None = None
    where: str = ""


@dataclass
class ParsedChat:
    messages: list[dict[str, Any]]
    #: every media part, in prompt order
    refs: list[MediaRef] = field(default_factory=list)

    @property
    def media(self) -> list[tuple[str, str]]:
        """(modality, url) of the parts that carry their media, in order (what is fetched)."""
        return [(r.modality, r.url) for r in self.refs if r.url is not None]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ref in self.refs:
            out[ref.modality] = out.get(ref.modality, 0) + 1
        return out


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_content_part", param="messages")


def _uuid(part: dict[str, Any], where: str) -> str | None:
    """A part's ``uuid``: a non-empty string of at most MAX_UUID_CHARS characters, or None."""
    uuid = part.get("uuid")
    if uuid is None:
        return None
    if not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS:
        raise InvalidRequestError(f"{where}.uuid must be a non-empty string of at most "
                                  f"{MAX_UUID_CHARS} characters", code="invalid_content_part",
                                  param=f"{where}.uuid")
    return uuid


def _left_out(part: dict[str, Any], kind: str, where: str, uuid: str | None) -> bool:
    """Whether a media part leaves its media out (``"image_url": null`` or no such key),
    which it may only with a ``uuid`` naming what it refers to."""
    if part.get(kind) is not None:
        return False
    if uuid is None:
        raise _bad(f"{where} ({kind}) has neither its media nor a uuid naming media sent "
                   "before")
    return True


def parse_messages(messages: Any) -> ParsedChat:
    """Validate OpenAI-style messages and pull out their media references, in order."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    parsed = ParsedChat([])
    for n, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"messages[{n}] needs a role ({', '.join(sorted(_ROLES))})")
        role = "system" if message["role"] == "developer" else message["role"]
        tools = tool_fields(message, n, role)
        content = message.get("content")
        if content is None or isinstance(content, str):
            parsed.messages.append({"role": role, "content": content or "", **tools})
            continue
        if not isinstance(content, list):
            raise _bad(f"messages[{n}].content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for k, part in enumerate(content):
            where = f"messages[{n}].content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            kind = kind if isinstance(kind, str) else None  # a list or object is no type
            uuid = _uuid(part, where) if kind in _MEDIA_KEYS else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{where} is a text part without a text string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _MEDIA_KEYS and _left_out(part, kind, where, uuid):
                modality = _URL_PARTS.get(kind, "audio")
                parsed.refs.append(MediaRef(modality, None, uuid, where))
                parts.append({"type": modality})
            elif kind in _URL_PARTS:
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise _bad(f"{where} ({kind}) has no url")
                modality = _URL_PARTS[kind]
                parsed.refs.append(MediaRef(modality, url, uuid, where))
                parts.append({"type": modality})
            elif kind == "input_audio":
                ref = part.get("input_audio")
                if not isinstance(ref, dict) or not isinstance(ref.get("data"), str):
                    raise _bad(f"{where} (input_audio) needs {{data: base64, format}}")
                fmt = str(ref.get("format", "wav")).lower()
                if fmt not in _AUDIO_FORMATS:
                    raise _bad(f"{where} input_audio format {fmt!r} is not one of "
                               f"{', '.join(_AUDIO_FORMATS)}")
                parsed.refs.append(MediaRef(
                    "audio", f"data:{_AUDIO_FORMATS[fmt]};base64,{ref['data']}", uuid, where))
                parts.append({"type": "audio"})
            else:
                raise _bad(f"{where} has unsupported type {kind!r}; use text, image_url, "
                           "video_url, audio_url or input_audio")
        parsed.messages.append({"role": role, "content": parts, **tools})
    return parsed
