"""Comments that point at a document point at one in the repository, and a request's steps
are numbered one way: CONTRIBUTING.md's request map, 1 (the front door) to 8 (the engine),
with 0 for the connections before a request."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("engine", "aphrodite_cli") for p in (ROOT / folder).rglob("*.py")]
STEPS = re.compile(r"\b[Ss]teps? (\d+)(?:\s*(?:-|to|and)\s*(\d+))?")


def test_the_documents_code_names_are_in_the_repository():
    named = {(path.name, doc) for path in SOURCES
             for doc in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", path.read_text())}
    assert named and not {(f, d) for f, d in named if not (ROOT / d).is_file()}


def test_step_numbers_are_the_request_maps():
    ranges = re.findall(r"^engine/\S+\s+(\d)(?:-(\d))?\.?\s",
                        (ROOT / "CONTRIBUTING.md").read_text(), re.M)
    map_steps = {n for low, high in ranges for n in range(int(low), int(high or low) + 1)}
    assert map_steps == set(range(0, 9))
    found = {(path.name, int(n)) for path in SOURCES
             for match in STEPS.finditer(path.read_text()) for n in match.groups() if n}
    assert found and not {(f, n) for f, n in found if n > 8}
