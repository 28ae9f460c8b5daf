"""All console output goes through here: one-line errors, JSON, tables."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from engine.errors import AphroditeError

# Piped into a file or a CI log, rich would lay tables out for 80 columns and cut numbers and
# names with "…": there, lines are as wide as their content needs.
out = Console(highlight=False, soft_wrap=True,
              width=None if sys.stdout.isatty() else 1000)
err = Console(stderr=True, highlight=False, soft_wrap=True,
              width=None if sys.stderr.isatty() else 1000)


def print_json(data: Any) -> None:
    """Machine-readable output on stdout, nothing else on that stream."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_error(error: AphroditeError) -> None:
    """``Error: message`` plus the hint on its own line, on stderr. The message is text, not
    markup: it may quote what a benchmark target or a file said (``[/code]`` included)."""
    from rich.markup import escape

    err.print(f"[bold red]Error:[/] {escape(error.message)}", markup=True, emoji=False)
    if error.hint:
        err.print(f"  [dim]hint:[/] {escape(error.hint)}", markup=True, emoji=False)


def warn(message: str) -> None:
    from rich.markup import escape

    err.print(f"[yellow]Warning:[/] {escape(message)}", markup=True, emoji=False)


def print_table(title: str, columns: list[str], rows: list[list[Any]],
                fmt: str = "table") -> None:
    """Results as a rich table (``table``), a Markdown pipe table (``markdown``, for pull
    requests and CI summaries) or JSON objects keyed by column (``json``, for scripts)."""
    if fmt == "json":
        print_json([dict(zip(columns, row, strict=True)) for row in rows])
        return
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(columns) + " |",
                 "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |"
                  for row in rows]
        sys.stdout.write("\n".join(lines) + "\n")
        return
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    out.print(table)
