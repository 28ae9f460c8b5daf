"""``aphrodite bench ...``: wiring only. Each command lives in its own module and registers
itself on the group's Typer app (``app.py``) when imported; the order below is the order
``--help`` lists them in."""

from __future__ import annotations

import importlib

from aphrodite_cli.bench.app import app

COMMAND_MODULES = (
    "cmd_offline",  # video-decode, mm-processor, batching
    "cmd_serve",  # serve
    "cmd_sweep",  # sweep
    "cmd_soak",  # soak
    "cmd_results",  # gate, report
    "cmd_mock",  # mock-server
)
for _name in COMMAND_MODULES:
    importlib.import_module(f"aphrodite_cli.bench.{_name}")

__all__ = ["app"]
