"""Flags shared by several commands, defined once with their help text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

AllowedMediaDomains = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-media-domains",
        help="Only fetch media from these exact hosts (repeat the flag or separate with commas). "
        "A listed host may resolve to private addresses; unlisted hosts on private addresses "
        "are always refused.",
        metavar="HOST",
    ),
]
AllowedLocalMediaPath = Annotated[
    Path | None,
    typer.Option(
        "--allowed-local-media-path",
        help="Folder that file:// media URLs may read from (no symlinks followed). "
        "Without it file:// URLs are refused.",
        metavar="DIR",
    ),
]


def split_hosts(values: list[str] | None) -> list[str]:
    """``--allowed-media-domains a,b --allowed-media-domains c`` -> ``[a, b, c]``."""
    return [h.strip() for v in values or [] for h in v.replace(" ", ",").split(",") if h.strip()]
