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
    """Benchmark runners (aphrodite_cli/bench, not its commands/ and the group's wiring) are
    plain functions a test or a script can call."""
    bench = ROOT / "aphrodite_cli" / "bench"
    for path in modules_under("aphrodite_cli/bench"):
        wiring = path.parent == bench / "commands" or path == bench / "cli.py"
        if not wiring:
            assert "typer" not in {m.split(".")[0] for m in imported_modules(path)}, path.name
    assert modules_under("engine") and modules_under("aphrodite_cli/bench")


#: The product's local harness the tests share with the benchmarks (see tests/fixtures.py).
HARNESS = ("aphrodite_cli.bench.harness",)


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, and every ``from module import name`` as module.name."""
    names = imported_modules(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_product_never_imports_the_tests():
    modules = modules_under("aphrodite_cli") + modules_under("engine")
    bad = {str(path.relative_to(ROOT)) for path in modules
           if any(m.split(".")[0] == "tests" for m in imported_modules(path))}
    assert len(modules) > 80 and not bad


def test_the_tests_take_the_harness_from_the_fixtures_module_alone():
    """Synthetic media, the media host and the server process reach the tests through
    tests/fixtures.py, so a move in the product changes one test file."""
    users = {path.name for path in modules_under("tests")
             if any(m == h or m.startswith(h + ".") for m in imported_names(path)
                    for h in HARNESS)}
    assert users == {"fixtures.py"}
