"""``aphrodite bench ...``: wiring only. Each command lives in its own module and registers
itself on the group's Typer app (``app.py``) when imported; the order below is the order
``--help`` lists them in."""

from __future__ import annotations

import importlib

from aphrodite_cli.bench.app import app

COMMAND_MODULES = (
    "offline",  # video-decode, mm-processor, batching
    "serve",  # serve
    "sweep",  # sweep
    "soak",  # soak
    "results",  # gate, report
    "mock_server",  # mock-server
)
for _name in COMMAND_MODULES:
    importlib.import_module(f"aphrodite_cli.bench.commands.{_name}")

__all__ = ["app"]
