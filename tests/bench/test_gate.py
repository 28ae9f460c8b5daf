"""The regression gate: no change passes, a real slowdown fails, noise passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aphrodite_cli.bench.results.gate import compare, parse_thresholds
from engine.errors import ConfigError

BIN = Path(sys.executable).with_name("aphrodite")


def result(path: Path, seed: int, scale: float = 1.0, n: int = 200) -> Path:
    rng = np.random.default_rng(seed)
    def draw(mu: float) -> list[float]:
        return list(rng.lognormal(np.log(mu), 0.25, n) * scale)

    path.write_text(json.dumps({"schema_version": 1, "kind": "serve", "phases": {
        "cold": {"samples": {"ttft_ms": draw(80), "tpot_ms": draw(12), "e2e_ms": draw(300)}},
        "warm": {"samples": {"ttft_ms": draw(40), "tpot_ms": draw(12), "e2e_ms": draw(250)}},
    }}))
    return path


def gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), "bench", "gate", *args], capture_output=True, text=True,
                          timeout=60)


def test_no_change_passes(tmp_path):
    base = result(tmp_path / "b.json", seed=1)
    done = gate("--baseline", str(base), "--candidate", str(base))
    assert done.returncode == 0 and "PASS" in done.stdout
    assert "| cold | ttft_ms |" in done.stdout  # a Markdown verdict table


def test_noise_passes(tmp_path):
    """Independent runs of the same distribution: different numbers, no regression."""
    base = [result(tmp_path / f"b{i}.json", seed=i) for i in range(3)]
    cand = [result(tmp_path / f"c{i}.json", seed=100 + i) for i in range(3)]
    verdicts = compare(base, cand)
    assert any(v.ratio != 1.0 for v in verdicts)
    assert not any(v.regressed for v in verdicts)


def test_real_slowdown_fails(tmp_path):
    base = result(tmp_path / "b.json", seed=1)
    slow = result(tmp_path / "s.json", seed=2, scale=1.3)
    done = gate("--baseline", str(base), "--candidate", str(slow), "--markdown",
                str(tmp_path / "verdict.md"))
    assert done.returncode == 1 and "REGRESSION" in done.stdout
    assert "**regression**" in (tmp_path / "verdict.md").read_text()


def test_speedup_is_not_a_regression_and_thresholds_apply(tmp_path):
    base = result(tmp_path / "b.json", seed=1)
    fast = result(tmp_path / "f.json", seed=2, scale=0.7)
    assert all(v.improved for v in compare([base], [fast]))
    slightly = result(tmp_path / "x.json", seed=3, scale=1.12)
    loose = compare([base], [slightly], parse_thresholds("ttft_ms:50%,tpot_ms:50%,e2e_ms:50%"))
    assert not any(v.regressed for v in loose)
    assert any(v.regressed for v in compare([base], [slightly]))
    with pytest.raises(ConfigError):
        parse_thresholds("ttft_ms:fast")


def test_a_result_of_another_kind_or_schema_is_refused_by_name(tmp_path):
    """One loader for the gate, the report and the soak: a file it cannot read right is a
    clear error naming the file and what it holds, never a silent misreading."""
    from aphrodite_cli.bench.results.files import SCHEMA_VERSIONS, load_result

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 0, "kind": "serve", "phases": {}}))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"schema_version": SCHEMA_VERSIONS["sweep"], "kind": "sweep",
                                 "phases": {}}))
    foreign = tmp_path / "vllm.json"
    foreign.write_text(json.dumps({"completed": 10, "mean_ttft_ms": 12.0}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    cut = tmp_path / "cut.json"  # the right kind and version, but not the fields read
    cut.write_text(json.dumps({"schema_version": SCHEMA_VERSIONS["serve"], "kind": "serve",
                               "phases": {"cold": {"samples": 3}}}))
    cases = [(old, ("serve",), "result_old_schema", "schema version 0"),
             (cut, ("serve",), "result_incomplete", "phases.cold"),
             (sweep, ("serve", "mm-processor"), "result_wrong_kind", "'sweep'"),
             (foreign, None, "result_wrong_kind", "not an aphrodite result"),
             (broken, None, "result_unreadable", "not JSON")]
    for path, kinds, code, words in cases:
        with pytest.raises(ConfigError) as info:
            load_result(path, kinds)
        assert info.value.code == code and words in info.value.message
        assert str(path) in info.value.message
    exe = Path(sys.executable).with_name("aphrodite")
    done = subprocess.run([str(exe), "bench", "gate", "--baseline", str(old), "--candidate",
                           str(old)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "schema version 0" in done.stdout + done.stderr
