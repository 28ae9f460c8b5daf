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
    from rich.text import Text

    cells = [["" if v is None else str(v) for v in row] for row in rows]
    # The narrowest each column can be without cutting a word or a number (text wraps at its
    # spaces only); one row per block when even that is wider than the terminal.
    narrowest = [max([len(w) for text in [col, *(c[i] for c in cells)] for w in text.split()]
                     + [1]) for i, col in enumerate(columns)]
    widths = [max([len(col)] + [len(c[i]) for c in cells]) for i, col in enumerate(columns)]
    room = out.size.width - 3 * len(columns) - 1  # borders and padding
    if sum(narrowest) > room:
        _print_blocks(title, columns, cells)
        return
    while sum(widths) > room:  # narrow the widest header that can wrap, one column at a time
        i = max((i for i in range(len(widths)) if widths[i] > narrowest[i]),
                key=lambda i: widths[i] - narrowest[i])
        widths[i] = max(narrowest[i], widths[i] - (sum(widths) - room))
    # Text, not markup: cells and titles may hold what a benchmark target sent
    table = Table(title=Text(title))
    for col, width in zip(columns, widths, strict=True):
        table.add_column(Text(col), width=width, overflow="fold")
    for row in cells:
        table.add_row(*(Text(c) for c in row))
    out.print(table)


def _print_blocks(title: str, columns: list[str], cells: list[list[str]]) -> None:
    """A table too wide for the terminal, one block per row: its first cell as the block's
    heading, then ``column  value`` lines; every number whole."""
    label = max(len(c) for c in columns[1:]) if len(columns) > 1 else 0
    out.print(title, markup=False, highlight=False)
    for row in cells:
        out.print(f"{columns[0]} {row[0]}", markup=False, highlight=False)
        for col, value in zip(columns[1:], row[1:], strict=True):
            out.print(f"  {col:<{label}}  {value}", markup=False, highlight=False)
