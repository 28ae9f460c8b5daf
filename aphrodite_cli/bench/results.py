"""Writing result files: one JSON per run, with the environment it ran in."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from aphrodite_cli.bench import environment

DEFAULT_DIR = Path("results")


def write_result(doc: dict[str, Any], kind: str, out_dir: Path | None = None, *,
                 filename: str | None = None) -> Path:
    """``results/<kind>-<UTC timestamp>.json`` (or under ``out_dir``; ``filename``: that
    name instead, as vLLM's --result-filename)."""
    folder = out_dir or DEFAULT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "environment": environment.capture(),
           "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if filename:
        path = folder / Path(filename).name
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        return path
    path = folder / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{n}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path
