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

``--request-rate``, ``--burstiness`` and ``--max-concurrency`` do not reschedule a trace (a
concurrency cap still holds requests back); ``--num-prompts`` caps the lines replayed.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.load.datasets import BenchRequest, MediaSpec
from aphrodite_cli.bench.load.media_files import read_lines, read_media
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
        return None, {"type": f"{kind}_url", f"{kind}_url": {"url": str(url)}}
    try:
        w, h, f = int(item["width"]), int(item["height"]), int(item.get("frames", 1))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where}: a media item needs url, path, or width and height",
                          code="invalid_dataset") from None
    if kind == "audio" or min(w, h, f) < 1:
        raise ConfigError(f"{where}: synthetic media are images or videos of positive size",
                          code="invalid_dataset")
    return MediaSpec("video" if f > 1 else "image", w, h, f, seed=seed), None


def load_trace(path: Path, media_dir: Path | None, *, limit: int, nonce: int
               ) -> list[BenchRequest]:
    """The trace's requests in arrival order, each with its ``arrival_s`` (the first at 0)."""
    rows: list[tuple[float, BenchRequest]] = []
    lines = read_lines(path, "trace")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
            arrival = (float(row["arrival_s"]) if "arrival_s" in row
                       else float(row["timestamp"]) / 1000)
            prompt = str(row.get("prompt", row.get("text", "")))
            output_len = int(row.get("output_len", row.get("output_length", 16)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"{where} is not a JSON object with arrival_s (or timestamp in "
                              "ms), prompt and output_len", code="invalid_dataset") from None
        if arrival < 0 or output_len < 1:
            raise ConfigError(f"{where}: arrival must be >= 0 and output_len >= 1",
                              code="invalid_dataset")
        specs, parts = [], []
        for k, item in enumerate(row.get("media") or []):
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
        kind = row.get("kind")
        rows.append((arrival, BenchRequest(prompt, specs, output_len, messages,
                                           kind=str(kind) if kind is not None else None)))
    if not rows:
        raise ConfigError(f"the trace {path} has no request", code="invalid_dataset")
    rows.sort(key=lambda r: r[0])
    rows = rows[:limit]
    start = rows[0][0]
    for arrival, req in rows:
        req.arrival_s = arrival - start
    return [req for _, req in rows]
