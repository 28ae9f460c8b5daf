"""Result files given to `bench gate` and `bench report` are hostile input too: a sample that
is NaN, infinite, negative, a boolean or a string, a file that is not UTF-8, too large or
missing is a one-line error naming the file, the row and the field, never a PASS, an
"improvement" or a traceback; the gate's memory is bounded whatever the sample count."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from aphrodite_cli.bench.results import gate, stats
from aphrodite_cli.bench.results.files import MAX_RESULT_BYTES, load_result
from engine.errors import ConfigError


def serve_file(path: Path, ttft: list, n: int = 50) -> Path:
    steady = [float(v) for v in np.linspace(80, 90, n)]
    path.write_text(json.dumps({"schema_version": 2, "kind": "serve", "phases": {
        "cold": {"samples": {"ttft_ms": ttft, "e2e_ms": steady}}}}, allow_nan=True))
    return path


@pytest.mark.parametrize(("bad", "says"), [
    (float("nan"), "finite number"),
    (float("inf"), "finite number"),
    (-40.0, "greater than or equal to 0"),
    (True, "valid number"),
    ("80", "valid number"),
])
def test_a_hostile_sample_is_named_not_gated(tmp_path, bad, says):
    """Today a NaN ttft gated as PASS, negative latencies as an improvement and true as 1."""
    base = serve_file(tmp_path / "base.json", [80.0 + i for i in range(50)])
    ttft = [80.0 + i for i in range(50)]
    ttft[7] = bad
    cand = serve_file(tmp_path / "cand.json", ttft)
    with pytest.raises(ConfigError, match=says) as info:
        gate.compare([base], [cand])
    message = info.value.message
    assert str(cand) in message and "phases.cold.samples.ttft_ms.7" in message
    assert "\n" not in message


def test_negative_latencies_are_not_an_improvement(tmp_path):
    base = serve_file(tmp_path / "base.json", [80.0 + i for i in range(50)])
    cand = serve_file(tmp_path / "cand.json", [-80.0 - i for i in range(50)])
    with pytest.raises(ConfigError, match="ttft_ms"):
        gate.compare([base], [cand])


def test_a_result_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(b'{"kind": "serve", "model": "caf\xe9"}')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_result(path)


def test_a_missing_result_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read result file .*missing\.json"):
        load_result(tmp_path / "missing.json")


def test_a_result_file_past_the_size_cap_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.json"
    with path.open("wb") as f:
        f.truncate(MAX_RESULT_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ConfigError, match="past the 256 MB") as info:
        load_result(path)
    assert info.value.code == "result_too_large"


def test_the_gate_keeps_a_bounded_spread_of_samples(tmp_path, monkeypatch):
    """Past MAX_SAMPLES a side keeps that many, spread evenly from the least to the most."""
    monkeypatch.setattr(gate, "MAX_SAMPLES", 1000)
    base = serve_file(tmp_path / "b.json", [float(v) for v in np.linspace(50, 150, 3000)])
    kept = gate.samples([base])[("cold", "ttft_ms")]
    assert len(kept) == 1000 and min(kept) == 50 and max(kept) == 150
    assert abs(float(np.median(kept)) - 100) < 0.1


def test_the_bootstrap_holds_a_block_of_resamples_at_a_time():
    """5000 samples a side: today 2000 resamples x 5000 were drawn at once (80 MB of values
    and 80 MB of indices per side); now a block of them, whatever the count."""
    values = np.linspace(50, 150, 5000)
    tracemalloc.start()
    try:
        ratio, low, high = stats.ratio_ci(values, values * 1.01)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert low <= ratio <= high and abs(ratio - 1.01) < 1e-3
    assert peak < 64 << 20, f"the bootstrap held {peak >> 20} MB at once"
