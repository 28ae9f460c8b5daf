"""The layers: ``engine`` (the product's core: server, executor, media, models) never imports
the command line or the benchmarks, Typer stays in ``aphrodite_cli``, and inside ``engine``
each layer of CONTRIBUTING's request map imports only from the layers below it. The layers
are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``), run here as
``lint-imports`` runs them; the import graph is grimp's, which they are checked on."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "aphrodite_cli")


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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build_graph() -> grimp.ImportGraph:
    # as the contracts see it: imports under `if TYPE_CHECKING:` never run
    return grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)


def test_the_import_graph_holds_every_module():
    """A folder without ``__init__.py`` is a namespace package that grimp does not walk: its
    modules would be outside every contract without a word."""
    graph = build_graph()
    files = {module_name(p) for package in PACKAGES for p in modules_under(package)}
    assert len(files) > 100 and files <= graph.modules


def test_the_layer_contracts_are_kept():
    """``lint-imports`` over pyproject's contracts: the CLI over the engine; in the engine
    server and LLM > executor > processing > media, models > config > envs > errors; in the
    benchmarks commands > load | offline > data > results | harness; no Typer or tests in the
    engine. A broken contract prints the offending import chain."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, "
         "no_logo=True))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "0 broken" in report, report
    # the benchmarks' own layers are among them (see aphrodite_cli/bench/__init__.py)
    assert "Benchmarks: commands > load | offline > data > results | harness KEPT" in report


def cycles_in(graph: grimp.ImportGraph, under: tuple[str, ...] = PACKAGES) -> set[str]:
    """Every import chain from a module (under ``under``) back to itself."""
    cycles = set()
    for module in graph.modules:
        if not module.startswith(under):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(imported, module)
            if back is not None:
                cycles.add(" -> ".join((module, *back)))
    return cycles


def test_no_import_cycles():
    """No module imports (through any chain) a module that imports it back, in the engine or
    in the command line: every package can be read, and imported, from the bottom up."""
    cycles = cycles_in(build_graph())
    assert not cycles, sorted(cycles)


def test_no_import_cycles_even_for_type_checkers():
    """Imports under ``if TYPE_CHECKING:`` count too, in the engine, the command line and the
    benchmarks: a type-only circle (capacity <-> sweep was one, and the server's app <->
    prepare/reply before its State had a module of its own) is still two modules that cannot
    be read apart."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=False)
    cycles = cycles_in(graph)
    assert not cycles, sorted(cycles)


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


def test_the_engine_and_its_lifecycle_import_without_torch():
    """The request lifecycle (engine, scheduler, stop, rows, the Runner protocol) runs without
    a model: torch and transformers are imported only where a model runs, so the fake-runner
    tests (tests/unit/test_engine_lifecycle.py) take milliseconds. (The import-linter contract
    "lifecycle-without-a-model" checks the modules' own imports; this, all they pull in.)"""
    code = ("import sys, engine.executor.engine, tests.fake_runner; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"
