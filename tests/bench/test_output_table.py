"""Result tables in a terminal: a number is never cut. In an 80-column terminal the serve
table once printed `ok/fa…` and `541.6…` for a TTFT p50/p99 pair; now a table that cannot
fit whole prints one block per row, and one that fits wraps headers at their spaces only."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from aphrodite_cli import output
from aphrodite_cli.bench.commands.serve import _print_serve_table


def _phase(ttft: tuple[float, float], hit: float) -> dict:
    flat = {f"p{q}_{m}_ms": v for m, pair in (("ttft", ttft), ("tpot", (12.1, 15.2)),
                                               ("itl", (11.9, 40.3)), ("e2el", (2541.6, 2612.3)))
            for q, v in zip((50, 99), pair, strict=True)}
    return {"completed": 50, "failed": 0, "request_throughput": 12.34,
            "output_throughput": 197.4, "server_cache": {"hit_rate": hit}, **flat}


DOC = {"num_prompts": 50, "percentile_metrics": ["ttft", "tpot", "itl", "e2el"],
       "metric_percentiles": [50.0, 99.0],
       "phases": {"cold": _phase((541.6, 612.3), 0.0), "warm": _phase((41.6, 62.3), 1.0)}}
NUMBERS = ["50/0", "12.34", "197.4", "541.6/612.3", "41.6/62.3", "12.1/15.2", "11.9/40.3",
           "2541.6/2612.3", "100%"]


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_no_number_is_cut_at_any_terminal_width(monkeypatch, width):
    screen = io.StringIO()
    monkeypatch.setattr(output, "out", Console(file=screen, width=width, force_terminal=True,
                                               color_system=None, soft_wrap=True))
    _print_serve_table(DOC)
    text = screen.getvalue()
    assert "…" not in text, text
    assert all(n in text for n in NUMBERS), text
    assert "ok/failed" in text
    assert max(len(line) for line in text.splitlines()) <= width, text
    if width >= 160:  # room for the table itself
        assert "┃ phase ┃ ok/failed ┃" in text


def test_table_text_is_not_markup(monkeypatch):
    """A title or a cell with what a target sent (a model id with rich markup) prints as it
    is, never as markup (no MarkupError on `[/code]`)."""
    screen = io.StringIO()
    monkeypatch.setattr(output, "out", Console(file=screen, width=120, force_terminal=True,
                                               color_system=None, soft_wrap=True))
    output.print_table("acme/[/code]-7b: every point", ["phase", "model"],
                       [["cold", "[bold]x[/bold]"]])
    assert "acme/[/code]-7b" in screen.getvalue() and "[bold]x[/bold]" in screen.getvalue()
