"""OpenAI chat messages -> template messages + the media they reference (no fetching).

Accepted content parts: ``text``; ``image_url`` ({url, detail}); ``video_url``; ``audio_url``;
``input_audio`` ({data: base64, format}). A string content is text. Anything else is a 400
naming the part.
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


@dataclass
class ParsedChat:
    messages: list[dict[str, Any]]
    media: list[tuple[str, str]] = field(default_factory=list)  # (modality, url)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for modality, _ in self.media:
            out[modality] = out.get(modality, 0) + 1
        return out


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_content_part", param="messages")


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
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{where} is a text part without a text string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _URL_PARTS:
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise _bad(f"{where} ({kind}) has no url")
                modality = _URL_PARTS[kind]
                parsed.media.append((modality, url))
                parts.append({"type": modality})
            elif kind == "input_audio":
                ref = part.get("input_audio")
                if not isinstance(ref, dict) or not isinstance(ref.get("data"), str):
                    raise _bad(f"{where} (input_audio) needs {{data: base64, format}}")
                fmt = str(ref.get("format", "wav")).lower()
                if fmt not in _AUDIO_FORMATS:
                    raise _bad(f"{where} input_audio format {fmt!r} is not one of "
                               f"{', '.join(_AUDIO_FORMATS)}")
                parsed.media.append(("audio", f"data:{_AUDIO_FORMATS[fmt]};base64,{ref['data']}"))
                parts.append({"type": "audio"})
            else:
                raise _bad(f"{where} has unsupported type {kind!r}; use text, image_url, "
                           "video_url, audio_url or input_audio")
        parsed.messages.append({"role": role, "content": parts, **tools})
    return parsed
