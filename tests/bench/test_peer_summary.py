"""scripts/peer_summary.py: the vLLM peer comparison's table, per model size, load and phase
(cold and warm), from real `bench serve` result files of two loopback targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import free_port, wait_exit, wait_listening

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("aphrodite")


@pytest.fixture
def two_targets():
    """Two mock servers: "vllm" answers its first token after 5 ms, "ours" after 60 ms."""
    procs, ports = [], []
    for ttft in (5, 60):
        port = free_port()
        procs.append(subprocess.Popen(
            [str(EXE), "bench", "mock-server", "--port", str(port), "--model", "peer",
             "--ttft-ms", str(ttft), "--itl-ms", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ports.append(port)
    assert all(wait_listening(port) for port in ports)
    yield dict(zip(("vllm", "ours"), ports, strict=True))
    for proc in procs:
        proc.terminate()
        assert wait_exit(proc, 30) is not None


def _bench(port: int, out: Path, name: str, *args: str) -> None:
    """One `bench serve` run against a mock target, its result written as ``out/name``."""
    done = subprocess.run(
        [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
         "--model", "peer", "--num-warmups", "0", "--items-per-request", "0", "--output-len",
         "3", *args, "--result-dir", str(out), "--result-filename", name],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _summarize(out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "peer_summary.py"),
                           str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "summary.json").read_text())


def test_the_summary_has_cold_and_warm_rows_per_size_with_ratios(two_targets, tmp_path):
    for side, port in two_targets.items():
        _bench(port, tmp_path, f"tiny-out3-c1-r1-{side}.json", "--num-prompts", "6",
               "--mode", "both")
    (tmp_path / "unrelated.json").write_text("{}")  # not a peer run: ignored
    rows = _summarize(tmp_path)
    assert [(r["size"], r["output_len"], r["phase"]) for r in rows] == [
        ("tiny", 3, "cold"), ("tiny", 3, "warm")]
    for row in rows:
        assert (row["runs_vllm"], row["runs_ours"]) == (1, 1)
        assert row["failed_vllm"] == row["failed_ours"] == 0
        assert row["ttft_p50_ours"] >= 60 > row["ttft_p50_vllm"]
        assert row["ttft_p50_ratio"] == pytest.approx(row["ttft_p50_ours"] /
                                                      row["ttft_p50_vllm"])
        assert row["rps_ratio"] == pytest.approx(row["rps_ours"] / row["rps_vllm"])
        # each mock server is a real process on loopback: its CPU per request was read (in
        # clock ticks: an idle mock may have spent none)
        assert row["cpu_ms_vllm"] >= 0 and row["cpu_ms_ours"] >= 0
        assert 0 <= row["busiest_cores_ours"] <= 1.5
    warm = rows[1]
    assert warm["ours_warm_over_cold_ttft"] == pytest.approx(
        warm["ttft_p50_ours"] / rows[0]["ttft_p50_ours"])
    md = (tmp_path / "summary.md").read_text()
    assert "| tiny | 3 tok, c1 | auto | cold |" in md
    assert "| tiny | 3 tok, c1 | auto | warm |" in md
    assert "Warm TTFT p50 over cold" in md
    # TPOT p50 of both and their ratio stand beside requests/s
    head = next(line for line in md.splitlines() if line.startswith("| size |"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    at = columns.index("req/s ours/vLLM")
    assert columns[at + 1:at + 4] == ["vLLM TPOT p50 ms", "ours TPOT p50 ms", "TPOT ours/vLLM"]
    for row in rows:
        assert row["tpot_p50_ratio"] == pytest.approx(row["tpot_p50_ours"] /
                                                      row["tpot_p50_vllm"])


def test_each_vllm_binding_is_compared_with_the_ours_runs_beside_it(two_targets, tmp_path):
    """VLLM_BINDS="auto 0-1": runs named -vllm@0-1 / -ours@0-1 (and @0+1 for "0|1") are
    their own rows, paired among themselves, never with the auto binding's runs."""
    import shutil

    for side, port in two_targets.items():
        _bench(port, tmp_path, f"small-out3-c1-r1-{side}.json", "--num-prompts", "4",
               "--mode", "cold")
    # the other bindings' runs: the roles swapped, so their ratios are the inverse
    for bind in ("0-1", "0+1"):
        shutil.copy(tmp_path / "small-out3-c1-r1-ours.json",
                    tmp_path / f"small-out3-c1-r1-vllm@{bind}.json")
        shutil.copy(tmp_path / "small-out3-c1-r1-vllm.json",
                    tmp_path / f"small-out3-c1-r1-ours@{bind}.json")
    rows = _summarize(tmp_path)
    assert [(r["vllm_binding"], r["runs_vllm"], r["runs_ours"]) for r in rows] == [
        ("auto", 1, 1), ("0-1", 1, 1), ("0|1", 1, 1)]
    auto, *others = rows
    assert auto["ttft_p50_ours"] >= 60 > auto["ttft_p50_vllm"]
    for other in others:
        assert other["ttft_p50_vllm"] >= 60 > other["ttft_p50_ours"]
        assert other["rps_ratio"] == pytest.approx(1 / auto["rps_ratio"])
        assert other["tpot_p50_ratio"] == pytest.approx(1 / auto["tpot_p50_ratio"])
    md = (tmp_path / "summary.md").read_text()
    assert "| small | 3 tok, c1 | 0-1 | cold |" in md
    assert "| small | 3 tok, c1 | 0\\|1 | cold |" in md  # (a pipe escaped in its cell)


def test_a_folder_without_peer_runs_is_an_error(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "peer_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1


def test_an_open_loop_load_has_its_own_rows_apart_from_the_closed_loop(two_targets, tmp_path):
    """`LOADS=64@0.6`: requests at a fixed rate are summarized apart from the same length and
    concurrency in a closed loop, labelled with their rate."""
    for side, port in two_targets.items():
        for name, extra in ((f"tiny-out3-c2-r1-{side}.json", []),
                            (f"tiny-out3-rate20-c2-r1-{side}.json", ["--request-rate", "20"])):
            _bench(port, tmp_path, name, "--num-prompts", "4", "--mode", "cold",
                   "--max-concurrency", "2", *extra)
    rows = _summarize(tmp_path)
    assert [(r["load"], r["request_rate"], r["runs_vllm"], r["runs_ours"]) for r in rows] == [
        ("3 tok, c2", None, 1, 1), ("3 tok, c2, 20 req/s", 20.0, 1, 1)]
    for row in rows:
        assert row["ttft_p50_ours"] >= 60 > row["ttft_p50_vllm"]
    md = (tmp_path / "summary.md").read_text()
    assert "| tiny | 3 tok, c2, 20 req/s | auto | cold |" in md
