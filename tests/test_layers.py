"""The layers: ``engine`` (the product's core: server, executor, media, models) never imports
the command line or the benchmarks, and Typer stays in ``aphrodite_cli``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def modules_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_engine_imports_neither_the_cli_nor_typer():
    modules = modules_under("engine")
    bad = {str(path.relative_to(ROOT)): sorted(
        m for m in imported_modules(path)
        if m.split(".")[0] in ("aphrodite_cli", "typer", "tests")) for path in modules}
    assert len(modules) > 50 and not {k: v for k, v in bad.items() if v}


def test_typer_is_imported_only_by_the_cli_and_the_benchmark_runners_do_not():
    """Benchmark runners (aphrodite_cli/bench, not its cmd_* modules and app wiring) are
    plain functions a test or a script can call."""
    for path in modules_under("aphrodite_cli/bench"):
        wiring = path.name.startswith("cmd_") or path.name in ("app.py", "cli.py")
        if not wiring:
            assert "typer" not in {m.split(".")[0] for m in imported_modules(path)}, path.name
    assert modules_under("engine") and modules_under("aphrodite_cli/bench")
