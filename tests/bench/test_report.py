"""The report: plots and Markdown from result files, and the HTML opened in a real headless
browser, which must load every plot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).with_name("aphrodite")


def serve_result(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def phase(scale: float, hit: float) -> dict:
        n = 30
        return {"completed": n, "failed": 0, "request_throughput": 5.0,
                "output_throughput": 80.0, "ttft_ms": {"median": 40 * scale, "p99": 90 * scale},
                "tpot_ms": {"median": 10.0}, "e2e_ms": {"median": 200 * scale},
                "server_cache": {"hit_rate": hit},
                "samples": {"ttft_ms": list(rng.lognormal(np.log(40 * scale), 0.3, n)),
                            "tpot_ms": list(rng.lognormal(np.log(10), 0.1, n)),
                            "e2e_ms": list(rng.lognormal(np.log(200 * scale), 0.2, n)),
                            "pixels": list(rng.integers(100_000, 2_000_000, n)),
                            "stages_ms": {"fetch_s": [2.0] * n, "processor_s": [12 * scale] * n,
                                          "prefill_s": [8.0] * n}}}

    path.write_text(json.dumps({"schema_version": 1, "kind": "serve", "environment": {
        "git_revision": "abc", "cpu_count": 2}, "phases": {"cold": phase(1.5, 0.0),
                                                             "warm": phase(1.0, 1.0)}},
                               default=int))
    return path


def test_report_outputs(tmp_path):
    result = serve_result(tmp_path / "serve-x.json")
    done = subprocess.run([str(BIN), "bench", "report", str(result), "--out-dir",
                           str(tmp_path / "rep")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| cold | 30 | 0 |" in md and "| warm |" in md
    assert len(list((tmp_path / "rep").glob("plot-*.png"))) == 3
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "http" not in html.split("<body")[1]


@pytest.mark.needs_browser
def test_report_renders_in_a_headless_browser(tmp_path):
    result = serve_result(tmp_path / "serve-x.json")
    subprocess.run([str(BIN), "bench", "report", str(result), "--out-dir",
                    str(tmp_path / "rep")], check=True, capture_output=True, timeout=120)
    page = tmp_path / "rep" / "report.html"
    dom = subprocess.run(
        [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'u'}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    expected = re.search(r'data-expected-plots="(\d+)"', dom)
    rendered = re.search(r'data-rendered-plots="(\d+)"', dom)
    assert expected and rendered, dom[:500]
    assert rendered.group(1) == expected.group(1) == "3"


def test_an_a_vs_b_report_opens_with_the_gates_verdict(tmp_path):
    """What gets published when two servers (or two commits) are compared: the verdict per
    metric with its interval, and both sides' latency CDFs per phase, from 0 to 1."""
    a = serve_result(tmp_path / "serve-a.json")
    b = tmp_path / "serve-b.json"
    doc = json.loads(a.read_text())
    for phase in doc["phases"].values():  # B: every TTFT 30% longer
        phase["samples"]["ttft_ms"] = [x * 1.3 for x in phase["samples"]["ttft_ms"]]
    b.write_text(json.dumps(doc))
    done = subprocess.run([str(BIN), "bench", "report", "--baseline", str(a), "--candidate",
                           str(b), "--out-dir", str(tmp_path / "rep")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert md.index("## A vs B") < md.index("## serve-a.json")
    assert "**Verdict: REGRESSION**" in md
    assert re.search(r"- cold ttft_ms: B is \+30\.0% \(95% CI .*\): slower", md)
    assert re.search(r"- cold e2e_ms: B is \+0\.0% .*: no significant change", md)
    html = (tmp_path / "rep" / "report.html").read_text()
    assert 'alt="A vs B: cold latency"' in html and 'alt="A vs B: warm latency"' in html


def test_every_batching_workload_reports_and_a_cut_result_is_refused_by_field(tmp_path):
    """Each result kind has a model of what its readers use: a mixed-workload batching result
    reports its static vs continuous table (it once raised KeyError: 'concurrency'), a copy
    cut short is refused naming the field (no traceback), and a writer cannot write a file
    the readers would refuse."""
    from pydantic import ValidationError

    from aphrodite_cli.bench.results.files import write_result

    def stats(value: float) -> dict:
        return {"median": value, "p99": value}

    doc = {"workload": "mixed", "num_prompts": 32, "long_share": 0.25, "long_tokens": 256,
           "short_tokens": 16, "max_num_seqs": 8,
           "static": {"output_throughput": stats(600.0), "request_throughput": stats(8.0),
                      "short_ttft_s": stats(1.5)},
           "continuous": {"output_throughput": stats(1500.0), "request_throughput": stats(20.0),
                          "short_ttft_s": stats(0.16)},
           "continuous_over_static_output_throughput": 2.5}
    path = write_result(doc, "batching", tmp_path)

    def report(*paths: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN), "bench", "report", *map(str, paths), "--out-dir",
                               str(tmp_path / "rep")], capture_output=True, text=True,
                              timeout=120)

    done = report(path)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| continuous | 1500.0 | 20.00 | 160 |" in md and "2.50x" in md
    cut = json.loads(path.read_text())
    del cut["continuous"]["request_throughput"]
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    done = report(tmp_path / "cut.json")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "continuous.request_throughput" in done.stdout + done.stderr
    with pytest.raises(ValidationError):
        write_result({"workload": "mixed", "static": doc["static"]}, "batching", tmp_path)
