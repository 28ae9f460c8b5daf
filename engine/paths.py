"""Where the toolkit keeps things outside the repository."""

from __future__ import annotations

from pathlib import Path

from engine import envs


def cache_root() -> Path:
    """``APHRODITE_CACHE_ROOT`` or ``~/.cache/aphrodite`` (created on demand)."""
    root = Path(envs.APHRODITE_CACHE_ROOT or Path.home() / ".cache" / "aphrodite").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
