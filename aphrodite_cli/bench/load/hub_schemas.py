"""The row shapes of public multimodal datasets that ``--dataset-name hf`` and ``sharegpt``
know, each row mapped to the chat request ``bench serve`` already sends (its media first,
then its text; one user message).

A schema is recognised by its columns, not by the dataset's name, so a copy or a subset of a
known dataset works under any name (the column names are those vLLM's benchmark datasets
read):

- VisionArena-Chat (``lmarena-ai/VisionArena-Chat``): ``conversation`` (turns of
  ``{role, content}`` messages; the first turn's first message is the prompt) and ``images``
  (the first one is sent, as vLLM sends it); ``lmarena-ai/vision-arena-bench-v0.1`` is the
  same with ``turns``.
- MMVU (``yale-nlp/MMVU``): ``question``, ``choices`` (``{letter: text}``, written after the
  question as ``A.text``) and ``video`` (a URL, or bytes).
- MMMU (``MMMU/MMMU``, a subject per ``--hf-subset``): ``question``, ``options`` (a list, or
  its Python text as MMMU stores it) and ``image_1`` ... ``image_7`` (those present).
- LLaVA-style conversations (ShareGPT4V, LLaVA-Instruct, LLaVA-OneVision, ShareGPT):
  ``conversations`` (``{from, value}``; the first human turn is the prompt, its ``<image>`` /
  ``<video>`` placeholders taken out) with ``image`` and ``video`` when present.

Media values as ``datasets`` gives them undecoded: ``{"bytes", "path"}`` (sent as a data URL,
its type read from its bytes), raw bytes, a PIL image (encoded again, as PNG), or a string:
an ``http(s)://`` or ``data:`` URL (sent as it is: the target fetches it) or a path read from
``--media-dir`` and nowhere else (ShareGPT4V's ``coco/train2017/...``).
"""

from __future__ import annotations

import ast
import base64
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aphrodite_cli.bench.data.datasets import BenchRequest
from aphrodite_cli.bench.data.media_files import MAX_MEDIA_FILE_BYTES, read_media
from engine.errors import ConfigError
from engine.media.sniff import sniff_mime

#: The longest prompt text a row may hold (characters; a hostile dataset could hold a GB)
MAX_PROMPT_CHARS = 1 << 22
_PLACEHOLDER = re.compile(r"<(?:image|video)>\s*")
_DEFAULT_MIME = {"image": "image/jpeg", "video": "video/mp4"}


class _RowError(Exception):
    """A row whose values do not fit its schema (turned into the row's one-line error)."""


def _get(value: Any, *keys: Any) -> Any:
    for key in keys:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise _RowError(f"has no {'/'.join(map(str, keys))}") from None
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _RowError(f"{what} is not a non-empty string")
    if len(value) > MAX_PROMPT_CHARS:
        raise _RowError(f"{what} is over {MAX_PROMPT_CHARS} characters")
    return value


def _choices(row: dict) -> str:
    question = _text(row["question"], "question")
    choices = row.get("choices")
    if isinstance(choices, dict):
        return question + " " + " ".join(f"{k}.{v}" for k, v in choices.items()
                                         if v is not None)
    return question


def _options(row: dict) -> str:
    question = _text(row["question"], "question")
    options = row.get("options")
    if isinstance(options, str):  # MMMU stores the list's Python text
        try:
            options = ast.literal_eval(options[:MAX_PROMPT_CHARS])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise _RowError("options is not a list") from None
    if not isinstance(options, list):
        return question
    return question + " " + " ".join(f"{chr(65 + i)}. {o}" for i, o in
                                     enumerate(options[:26]))


def _first_human(row: dict) -> str:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise _RowError("conversations is not a non-empty list")
    first = next((t for t in turns if isinstance(t, dict) and t.get("from") in
                  ("human", "user")), turns[0])
    text = _text(_get(first, "value"), "the first turn's value")
    return _PLACEHOLDER.sub("", text).strip() or text


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


@dataclass(frozen=True)
class Schema:
    name: str
    columns: tuple[str, ...]  # every one present
    prompt: Callable[[dict], str]
    media: Callable[[dict], list[tuple[str, Any]]]  # (image | video, value) in order


SCHEMAS = (
    Schema("VisionArena-Chat", ("conversation", "images"),
           lambda r: _text(_get(r, "conversation", 0, 0, "content"), "conversation[0][0]"),
           lambda r: [("image", v) for v in _listed(r["images"])[:1]]),
    Schema("vision-arena-bench", ("turns", "images"),
           lambda r: _text(_get(r, "turns", 0, 0, "content"), "turns[0][0]"),
           lambda r: [("image", v) for v in _listed(r["images"])[:1]]),
    Schema("MMVU", ("question", "choices", "video"), _choices,
           lambda r: [("video", r["video"])]),
    Schema("MMMU", ("question", "options", "image_1"), _options,
           lambda r: [("image", r[f"image_{i}"]) for i in range(1, 8)
                      if r.get(f"image_{i}") is not None]),
    Schema("LLaVA conversations", ("conversations",), _first_human,
           lambda r: [(kind, v) for kind in ("image", "video")
                      for v in _listed(r.get(kind)) if v is not None]),
)
KNOWN = ("VisionArena-Chat (conversation, images), MMVU (question, choices, video), MMMU "
         "(question, options, image_1..image_7), LLaVA/ShareGPT4V/ShareGPT (conversations, "
         "image, video)")


def find_schema(columns: list[str], only: str | None = None) -> Schema | None:
    """The first known schema whose columns ``columns`` holds (``only``: that one alone)."""
    return next((s for s in SCHEMAS if set(s.columns) <= set(columns)
                 and (only is None or s.name == only)), None)


def unknown_schema(path: str, columns: list[str]) -> ConfigError:
    shown = ", ".join(c[:40] for c in columns[:40]) + (", ..." if len(columns) > 40 else "")
    return ConfigError(f"--dataset-path {path}: no known dataset schema has the columns "
                       f"({shown or 'none'})", hint=f"known: {KNOWN}; or write the requests "
                       "as --dataset-name jsonl", code="invalid_dataset")


def media_url(kind: str, value: Any, media_dir: Any, where: str = "a row") -> str:
    """One media value (see the module's docstring) as the URL a content part carries."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path") or value.get("src")
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buffer = io.BytesIO()
        try:
            value.save(buffer, format="PNG")
        except (OSError, ValueError) as exc:
            raise _RowError(f"its {kind} cannot be encoded ({type(exc).__name__})") from None
        value = buffer.getvalue()
    if isinstance(value, str):
        if value.startswith(("http://", "https://", "data:")):
            return value
        value = read_media(media_dir, value, f"{where}'s {kind}")
    if not isinstance(value, bytes) or not value:
        raise _RowError(f"its {kind} is not bytes, an image, a URL or a path")
    if len(value) > MAX_MEDIA_FILE_BYTES:
        raise _RowError(f"its {kind} is over {MAX_MEDIA_FILE_BYTES >> 20} MB")
    mime = sniff_mime(value)
    if mime is None or not mime.startswith(f"{kind}/"):
        mime = _DEFAULT_MIME[kind]  # the target judges what the bytes are
    return f"data:{mime};base64,{base64.b64encode(value).decode()}"


def to_request(row: dict, schema: Schema, where: str, *, output_len: int,
               media_dir: Any = None) -> BenchRequest:
    """One row as a chat request; a row that does not fit is a one-line error naming it."""
    try:
        text = schema.prompt(row)
        parts: list[dict[str, Any]] = []
        for kind, value in schema.media(row):
            if value is None:  # this row has none (an MMVU question without its video)
                continue
            part = f"{kind}_url"
            parts.append({"type": part, part: {"url": media_url(kind, value, media_dir, where)}})
    except _RowError as exc:
        raise ConfigError(f"{where} ({schema.name}): {exc}", code="invalid_dataset") from None
    parts.append({"type": "text", "text": text})
    return BenchRequest(text, [], output_len, [{"role": "user", "content": parts}])
