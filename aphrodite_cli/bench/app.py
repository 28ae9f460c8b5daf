"""The ``aphrodite bench`` command group; its commands live in the ``cmd_*`` modules."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks that write result files.", no_args_is_help=True)
