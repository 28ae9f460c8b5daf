"""The console script's entry point (``aphrodite``): imports the command line, then runs it.

A Ctrl-C while the command line imports (Typer, rich and the engine's modules, the first half
second) ends it with the shell's code for an interrupt (130) and no traceback, as it does
once the command runs (Click's "Aborted!")."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from aphrodite_cli.main import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    run()
