"""The environment a benchmark ran in, recorded in every result file."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("aphrodite-toolkit", "torch", "torchvision", "torchcodec", "transformers", "av",
            "opencv-python-headless", "pillow", "numpy", "aiohttp")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(*cmd: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_revision() -> str | None:
    root = Path(__file__).resolve().parents[3]
    rev = _run("git", "-C", str(root), "rev-parse", "--short=12", "HEAD")
    dirty = _run("git", "-C", str(root), "status", "--porcelain", "--untracked-files=no")
    return f"{rev}{'-dirty' if dirty else ''}" if rev else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_names() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
    return [line.strip() for line in (out or "").splitlines() if line.strip()]


def ffmpeg_version() -> str | None:
    if shutil.which("ffmpeg") is None:
        return None
    out = _run("ffmpeg", "-hide_banner", "-version")
    return out.splitlines()[0] if out else None


def capture() -> dict[str, Any]:
    """Package versions, CPU/GPU, FFmpeg, Python, OS and the git revision."""
    return {
        "packages": {name: _version(name) for name in PACKAGES},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
        "ffmpeg_cli": ffmpeg_version(),
        "git_revision": git_revision(),
    }
