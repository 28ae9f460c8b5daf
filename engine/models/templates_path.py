"""Chat templates shipped with the toolkit (``engine/models/templates/*.jinja``)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"


def template_path(name: str) -> Path:
    return TEMPLATES / f"{name}.jinja"


def template_text(name: str) -> str:
    return template_path(name).read_text()
