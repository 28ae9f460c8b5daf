"""The test tiers (docs/testing.md): one folder each, by what a test needs to run, and the
fixtures that need a tier whatever the folder (a bench test that asks the ``served`` fixture
starts a real server, so it is a ``server`` test too). ``tests/unit`` promises no model, no
server and no media: a unit test that asks such a fixture is refused at collection."""

from __future__ import annotations

from collections.abc import Iterable

TIERS = ("unit", "media", "engine", "server", "bench", "vllm")

#: fixture -> the tier it brings: a real ``aphrodite serve`` (tests/served.py), a loopback
#: media host that real fetches go to (tests/media_server.py)
FIXTURE_TIERS = {"served": "server", "media_server": "media"}


class TierError(Exception):
    """A test asks a fixture its folder's tier promises not to need."""


def tiers_of(folder: str, fixtures: Iterable[str]) -> set[str]:
    """The tier markers of a test in ``tests/<folder>`` asking ``fixtures``."""
    tiers = {folder} if folder in TIERS else set()
    brought = {FIXTURE_TIERS[f]: f for f in fixtures if f in FIXTURE_TIERS}
    if folder == "unit" and brought:
        tier, fixture = sorted(brought.items())[0]
        raise TierError(f"a tests/unit test asks the '{fixture}' fixture ({tier} tier): "
                        f"move it to tests/{tier}/ (tests/unit: no model, server or media)")
    return tiers | set(brought)
