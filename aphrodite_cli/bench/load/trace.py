"""Replay of a timed trace (``--dataset-name trace --dataset-path F.jsonl``): each request is
sent at its recorded arrival time, with its prompt, media and output length.

One JSON object per line:

- ``arrival_s`` (seconds after the trace's start) or AIPerf's ``timestamp`` (milliseconds);
  lines are replayed in arrival order, the first at 0 (the trace's own offset is removed);
- ``prompt`` (or AIPerf's ``text``);
- ``output_len`` (or AIPerf's ``output_length``), default 16;
- ``media`` (optional): a list of items, each ``{"type": "image"|"video"|"audio", "url":
  ...}`` (sent as given), ``{"type": ..., "path": ...}`` (read from ``--media-dir``, sent
  inline), or a synthetic item ``{"type": "image"|"video", "width": W, "height": H,
  "frames": F}`` made like random-mm's (new to the server in a cold phase);
- ``kind`` (optional): a name for the per-kind breakdown.

Every field is checked as read (:mod:`~aphrodite_cli.bench.load.row_fields`): an arrival
that is not a finite number of seconds within a week of the start, an ``output_len`` that is
not a whole number (``true`` is not 1), a prompt that is not a string or a synthetic size past
:mod:`~aphrodite_cli.bench.harness.synthetic_caps` is a one-line error naming the line and the
field.

``--request-rate``, ``--burstiness`` and ``--max-concurrency`` do not reschedule a trace (a
concurrency cap still holds requests back); ``--num-prompts`` caps the lines replayed.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.data.datasets import BenchRequest, MediaSpec
from aphrodite_cli.bench.data.media_files import read_lines, read_media
from aphrodite_cli.bench.harness.synthetic_caps import MAX_FRAMES, MAX_SIDE, check_size
from aphrodite_cli.bench.load.row_fields import (
    MAX_CLOCK,
    MAX_OUTPUT_TOKENS,
    check_span,
    number,
    text,
    whole,
)
from engine.errors import ConfigError

_MIME = {"image": "image/jpeg", "video": "video/mp4", "audio": "audio/wav"}


def _media(item: Any, where: str, media_dir: Path | None, seed: int
           ) -> tuple[MediaSpec | None, dict[str, Any] | None]:
    """(a synthetic item, or a chat content part)."""
    if not isinstance(item, dict) or item.get("type") not in _MIME:
        raise ConfigError(f"{where}: a media item is an object with type image, video or "
                          "audio", code="invalid_dataset")
    kind = item["type"]
    if "url" in item or "path" in item:
        url = item.get("url")
        if url is None:
            data = read_media(media_dir, item["path"], where)
            url = f"data:{_MIME[kind]};base64,{base64.b64encode(data).decode()}"
        else:
            url = text(url, where, "a media item's url")
        return None, {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    if kind == "audio" or "width" not in item or "height" not in item:
        raise ConfigError(f"{where}: a media item needs url, path, or width and height "
                          "(synthetic media are images or videos)", code="invalid_dataset")
    w = whole(item["width"], where, "width", 1, MAX_SIDE)
    h = whole(item["height"], where, "height", 1, MAX_SIDE)
    f = whole(item.get("frames", 1), where, "frames", 1, MAX_FRAMES)
    check_size(where, w, h, f)
    return MediaSpec("video" if f > 1 else "image", w, h, f, seed=seed), None


def _row(line: str, where: str) -> tuple[float, str, int, list, str | None]:
    """(arrival in seconds, prompt, output_len, media items, kind) of one line."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        raise ConfigError(f"{where} is not JSON", code="invalid_dataset") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is not a JSON object with arrival_s (or timestamp in ms), "
                          "prompt and output_len", code="invalid_dataset")
    if "arrival_s" in row:
        arrival = number(row["arrival_s"], where, "arrival_s", 0, MAX_CLOCK)
    elif "timestamp" in row:
        arrival = number(row["timestamp"], where, "timestamp", 0, MAX_CLOCK * 1000) / 1000
    else:
        raise ConfigError(f"{where} has neither arrival_s nor timestamp (ms)",
                          code="invalid_dataset")
    prompt_field = "prompt" if "prompt" in row else "text"
    prompt = text(row.get(prompt_field, ""), where, prompt_field)
    out_field = "output_len" if "output_len" in row else "output_length"
    output_len = whole(row.get(out_field, 16), where, out_field, 1, MAX_OUTPUT_TOKENS)
    media = row.get("media") or []
    if not isinstance(media, list):
        raise ConfigError(f"{where}: media is a list of items", code="invalid_dataset")
    kind = row.get("kind")
    return arrival, prompt, output_len, media, (None if kind is None
                                                else text(kind, where, "kind"))


def load_trace(path: Path, media_dir: Path | None, *, limit: int, nonce: int
               ) -> list[BenchRequest]:
    """The trace's requests in arrival order, each with its ``arrival_s`` (the first at 0)."""
    rows: list[tuple[float, BenchRequest]] = []
    lines = read_lines(path, "trace")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        arrival, prompt, output_len, media, kind = _row(line, where)
        specs, parts = [], []
        for k, item in enumerate(media):
            spec, part = _media(item, where, media_dir, nonce * 1_000_000 + n * 100 + k)
            if spec is not None:
                specs.append(spec)
            else:
                parts.append(part)
        if specs and parts:
            raise ConfigError(f"{where}: mix synthetic media with url/path media in separate "
                              "lines", code="invalid_dataset")
        messages = ([{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]
                    if parts else None)
        rows.append((arrival, BenchRequest(prompt, specs, output_len, messages, kind=kind)))
    if not rows:
        raise ConfigError(f"the trace {path} has no request", code="invalid_dataset")
    rows.sort(key=lambda r: r[0])
    rows = rows[:limit]
    check_span(path, rows[0][0], rows[-1][0])
    start = rows[0][0]
    for arrival, req in rows:
        req.arrival_s = arrival - start
    return [req for _, req in rows]
