"""Names in result files (phases, models, backends, labels, file names) are a stranger's
words: escaped in the Markdown summary as in the HTML report, and drawn in plots as written,
never parsed as matplotlib mathtext; a field of the wrong type is a one-line error naming the
file, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aphrodite_cli.bench.results.report import write_report
from engine.errors import ConfigError

PHASE = "$\\frac{$<b>x</b>|**y**"  # unbalanced mathtext, HTML, a table pipe, emphasis


def serve_doc(path: Path, phase: str = PHASE, **extra) -> Path:
    samples = {"ttft_ms": [40.0, 41.0, 45.0], "e2e_ms": [200.0, 210.0, 230.0],
               "pixels": [1000, 2000, 3000], "stages_ms": {"fetch_ms": [1.0, 1.0, 1.0]}}
    path.write_text(json.dumps({"schema_version": 2, "kind": "serve", "environment": {
        "git_revision": "$x$ <i>|", "cpu_count": 2}, "config": {"model": "m$|<img src=x>"},
        "dataset": "d|**e**", "phases": {phase: {"completed": 3, "samples": samples, **extra}}}))
    return path


def test_names_are_escaped_in_markdown_and_html_and_never_mathtext(tmp_path):
    result = serve_doc(tmp_path / "serve-$a$|b.json")
    html_path, md_path = write_report([result], tmp_path / "rep")
    md = md_path.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| $"))
    assert row.count(" | ") == 15, row  # 16 cells: the phase's pipe is escaped
    assert r"\<b\>x\</b\>\|\*\*y\*\*" in row
    assert r"m$\|\<img src=x\>" in md and r"d\|\*\*e\*\*" in md
    html = html_path.read_text()
    assert "<b>x</b>" not in html and "<img src=x>" not in html and "<i>" not in html
    assert "&lt;b&gt;x&lt;/b&gt;|**y**" in html  # shown as written
    assert len(list((tmp_path / "rep").glob("plot-*.png"))) == 3  # mathtext would raise


def test_a_field_of_the_wrong_type_is_a_one_line_error_naming_the_file(tmp_path):
    result = serve_doc(tmp_path / "serve.json", "cold",
                       slices={"seconds": 1, "intervals": [{"start_s": "zero"}]})
    with pytest.raises(ConfigError) as info:
        write_report([result], tmp_path / "rep")
    assert str(result) in info.value.message and "\n" not in info.value.message


def test_plots_draw_a_name_with_dollars_as_written(tmp_path):
    """An unbalanced ``$\\frac{`` phase name: today matplotlib's mathtext parser raised."""
    from aphrodite_cli.bench.results.files import load_result
    from aphrodite_cli.bench.results.report import plots

    path = serve_doc(tmp_path / "serve.json")
    images = plots([(path, load_result(path))])
    assert len(images) == 3 and all(png.startswith(b"\x89PNG") for _, png in images)
