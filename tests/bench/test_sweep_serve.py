"""``bench sweep serve``: server flag sets x bench flag sets, one server per serve set, one serve
result per combination, a summary with the Pareto front, and the report's Pareto plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aphrodite_cli.bench.load.sweep_params import as_flags, last_error, parse_params
from aphrodite_cli.bench.load.sweep_serve import BENCH_RESERVED, mark_fronts, pareto_front
from engine.errors import ConfigError

EXE = Path(sys.executable).with_name("aphrodite")


def sweep(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), "bench", "sweep", "serve", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize(("text", "said"), [
    ('{"max_num_seqs": 4}', "must be a JSON list of objects .flag name -> value., got dict"),
    ("[]", "got an empty list"),
    ('[{"a": 1}, 3, "x"]', "a list holding int, str"),
    ('[{"a": 1', "is not JSON"),
    ("no/such/file.json", "neither a JSON list nor a readable file"),
    ('[{"--x": 1}]', "is not a flag name"),
    ('[{"base_url": "http://h"}]', "--base-url is set by the sweep itself"),
])
def test_params_that_are_not_a_list_of_flag_objects_are_refused(text, said):
    with pytest.raises(ConfigError, match=said):
        parse_params(text, "--bench-params", reserved=BENCH_RESERVED)


def test_params_from_a_file_and_as_flags(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('[{"max_num_seqs": 8, "enable_prefix_caching": false, "x": null}]')
    assert parse_params(str(path), "--serve-params") == [
        {"max_num_seqs": 8, "enable_prefix_caching": False, "x": None}]
    assert parse_params(None, "--serve-params") == [{}]
    assert as_flags({"max_num_seqs": 8, "enable_prefix_caching": False, "x": None,
                     "ignore-eos": True, "header": ["a=1", "b=2"],
                     "extra_body": {"k": [1]}}) == [
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--ignore-eos",
        "--header", "a=1", "--header", "b=2", "--extra-body", '{"k": [1]}']


def test_the_pareto_front_is_what_nothing_beats_on_both_axes():
    points = [(100, 10), (50, 20), (40, 15), (100, 5), (None, 99), (10, 30)]
    assert pareto_front(points) == [0, 1, 5]
    runs = [{"phases": {"cold": {"total_token_throughput": x,
                                 "output_token_throughput_per_user": y}}} for x, y in points]
    assert mark_fronts(runs) == {"cold": [0, 1, 5]}
    assert [r["phases"]["cold"]["pareto"] for r in runs] == [True, True, False, False, False,
                                                             True]


def test_last_error_is_the_text_of_typers_box():
    text = ("Usage: aphrodite serve [OPTIONS]\n╭─ Error ───╮\n│ No such option: --max-num-x "
            "│\n│ (Possible options: --max-num-seqs) │\n╰───╯\n")
    assert last_error(text) == "No such option: --max-num-x (Possible options: --max-num-seqs)"
    assert last_error("a\nError: bad thing\n  hint: x\n") == "Error: bad thing"


def test_bad_params_and_commands_are_one_line_errors(tmp_path):
    done = sweep("--serve-params", '{"max_num_seqs": 4}', "-o", str(tmp_path))
    assert done.returncode == 2 and "must be a JSON list of objects" in done.stderr
    assert "Traceback" not in done.stderr
    done = sweep("--serve-cmd", "aphrodite bench mock-server", "-o", str(tmp_path))
    assert done.returncode == 2 and "has no {port}" in done.stderr
    # an unknown server flag: the server's own one-line error, naming the combination
    done = sweep("--serve-params", '[{"max_num_sequences": 4}]', "-o", str(tmp_path))
    assert done.returncode == 2, done.stderr
    line = next(ln for ln in done.stderr.splitlines() if "did not start" in ln)
    assert "--serve-params set #0 (max_num_sequences=4)" in line
    assert "No such option: --max-num-sequences" in line and "Traceback" not in done.stderr
    # an unknown bench flag: bench serve's own error, naming the combination
    done = sweep("--serve-cmd", "aphrodite bench mock-server --port {port}", "--bench-params",
                 '[{"num_promptz": 2}]', "-o", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "--bench-params set #0 (num_promptz=2)" in done.stderr
    assert "No such option: --num-promptz" in done.stderr
    assert not list(tmp_path.glob("*/summary.json"))


def test_dry_run_prints_the_product_and_runs_nothing(tmp_path):
    done = sweep("--serve-params", '[{"max_num_seqs": 1}, {"max_num_seqs": 2}]',
                 "--bench-params", '[{"max_concurrency": 1}, {"max_concurrency": 4}]',
                 "--dry-run", "-o", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(ln.startswith("server #") for ln in lines) == 2
    assert sum("bench #" in ln for ln in lines) == 4
    assert "--max-num-seqs 2 --port {port}" in done.stdout and "--max-concurrency 4" in done.stdout
    assert not list(tmp_path.iterdir())


def test_a_server_command_template_swept_against_two_loads(tmp_path):
    """A mock whose capacity is the swept server flag: one server per set (2), both bench
    sets against each (4 results), the summary's front, the report's Pareto plot."""
    done = sweep("--serve-cmd", "aphrodite bench mock-server --port {port} --ttft-ms 20 "
                 "--itl-ms 5", "--serve-params", '[{"max_concurrency": 1}, '
                 '{"max_concurrency": 4}]', "--bench-params",
                 '[{"max_concurrency": 1}, {"max_concurrency": 4}]', "--bench-cmd",
                 "aphrodite bench serve --dataset-name random --num-prompts 8 --num-warmups 0 "
                 "--mode cold --output-len 4 --no-server-cpu --no-reset-caches",
                 "-o", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    folder = next(tmp_path.glob("sweep-serve-*"))
    results = sorted(folder.glob("serve-s*-b*.json"))
    assert [p.name for p in results] == ["serve-s0-b0.json", "serve-s0-b1.json",
                                         "serve-s1-b0.json", "serve-s1-b1.json"]
    one = json.loads(results[3].read_text())
    assert one["kind"] == "serve" and one["phases"]["cold"]["completed"] == 8
    assert one["sweep"]["serve_params"] == {"max_concurrency": 4}
    assert one["sweep"]["bench_params"] == {"max_concurrency": 4}
    assert one["config"]["max_concurrency"] == 4
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["kind"] == "sweep-serve" and len(summary["runs"]) == 4
    assert {r["exit_code"] for r in summary["runs"]} == {0}
    # four servers and four clients serve the most tokens in total (4x the others' capacity
    # on this mock): on the front; no front point is beaten on both axes by another run
    rows = [r["phases"]["cold"] for r in summary["runs"]]
    best = max(range(4), key=lambda i: rows[i]["total_token_throughput"])
    assert summary["runs"][best]["serve_params"] == {"max_concurrency": 4}
    assert summary["runs"][best]["bench_params"] == {"max_concurrency": 4}
    front = summary["pareto"]["cold"]
    assert best in front and all(rows[i]["pareto"] == (i in front) for i in range(4))
    for i in front:
        assert not any(o["total_token_throughput"] > rows[i]["total_token_throughput"] and
                       o["output_token_throughput_per_user"] >
                       rows[i]["output_token_throughput_per_user"] for o in rows)
    from aphrodite_cli.bench.results.report import write_report

    html_path, md_path = write_report([folder / "summary.json"], tmp_path / "r")
    assert "Pareto front (cold)" in html_path.read_text()
    assert md_path.read_text().count("| cold |") == 4


def test_two_max_num_seqs_values_on_the_embedded_server(tmp_path):
    """Done-when: a sweep over two --max-num-seqs values of the embedded server (tiny model)
    writes two results, each recording its value, and a summary the report plots."""
    done = sweep("--serve-params", '[{"max_num_seqs": 1}, {"max_num_seqs": 4}]',
                 "--bench-cmd", "aphrodite bench serve --dataset-name random --num-prompts 3 "
                 "--num-warmups 0 --mode cold --output-len 2 --max-concurrency 3 "
                 "--no-server-cpu", "-o", str(tmp_path), timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    folder = next(tmp_path.glob("sweep-serve-*"))
    results = sorted(folder.glob("serve-s*-b0.json"))
    assert len(results) == 2
    docs = [json.loads(p.read_text()) for p in results]
    assert [d["sweep"]["serve_params"]["max_num_seqs"] for d in docs] == [1, 4]
    assert all(d["phases"]["cold"]["completed"] == 3 for d in docs)
    assert "--max-num-seqs" in " ".join(docs[1]["sweep"]["serve_cmd"])
    from aphrodite_cli.bench.results.report import write_report

    html_path, _ = write_report([folder / "summary.json"], tmp_path / "r")
    assert "Pareto front (cold)" in html_path.read_text()
    assert (tmp_path / "r" / "plot-0.png").stat().st_size > 1000
