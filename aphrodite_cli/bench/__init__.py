"""Benchmark runners, result schema and reports (no Typer here; see ``cli.py``)."""
