"""Result files: a file missing a field its readers need is refused naming that field (not
only a field of the wrong type), and version 1 serve/sweep files, whose server stages were
named ``*_s`` while holding milliseconds, are read upgraded to the ``*_ms`` names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aphrodite_cli.bench.load.metrics import RequestRecord, compute
from aphrodite_cli.bench.results.files import SCHEMA_VERSIONS, load_result
from engine.errors import ConfigError


def _write(path, doc: dict):
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("kind", "doc", "named"), [
    ("serve", {}, "phases"),
    ("serve", {"phases": {"cold": {"completed": 3}}}, "phases.cold.samples"),
    ("sweep", {}, "phases"),
    ("sweep", {"phases": {"cold": {"capacity": None}}}, "phases.cold.points"),
    ("sweep", {"phases": {"cold": {"points": [{"kind": "rate"}]}}},
     "phases.cold.points.0.result"),
    ("decode-step", {"num_threads": 1, "bandwidth": {"gb_s": {"median": 9.0}}}, "rows"),
    ("decode-step", {"num_threads": 1, "bandwidth": {"gb_s": {}}, "rows": [{
        "batch_size": 1, "context_len": 8, "step_ms": {}, "weight_bytes": 1, "kv_bytes": 1,
        "bytes": 2, "floor_ms": 1.0}]}, "rows.0.ratio_to_floor"),
])
def test_a_result_missing_a_required_field_is_refused_naming_it(tmp_path, kind, doc, named):
    path = _write(tmp_path / f"{kind}.json",
                  {"schema_version": SCHEMA_VERSIONS[kind], "kind": kind, **doc})
    with pytest.raises(ConfigError) as info:
        load_result(path)
    assert info.value.code == "result_incomplete"
    assert f"{named} (Field required)" in info.value.message, info.value.message


def test_server_stages_are_named_in_ms():
    record = RequestRecord(0, ok=True, ttft=0.1, e2e=0.5, output_tokens=2,
                           server={"timings": {"decode_s": 0.352, "processor_s": 0.01}})
    stages = compute([record], 1.0)["server_stages_ms"]
    assert set(stages) == {"decode_ms", "processor_ms"}
    assert stages["decode_ms"]["median"] == pytest.approx(352.0)


def test_a_version_1_file_is_read_with_its_stages_renamed(tmp_path):
    stages = {"decode_s": {"median": 352.0}, "processor_s": {"median": 10.0}}
    old = _write(tmp_path / "serve-old.json", {
        "schema_version": 1, "kind": "serve", "phases": {"cold": {
            "server_stages_ms": stages,
            "samples": {"ttft_ms": [1.0], "stages_ms": {"decode_s": [352.0]}}}}})
    doc = load_result(old)
    cold = doc["phases"]["cold"]
    assert doc["schema_version"] == SCHEMA_VERSIONS["serve"] == 2
    assert doc["upgraded_from"] == 1
    assert cold["server_stages_ms"]["decode_ms"] == {"median": 352.0}
    assert cold["samples"]["stages_ms"] == {"decode_ms": [352.0]}
    sweep = _write(tmp_path / "sweep-old.json", {
        "schema_version": 1, "kind": "sweep", "phases": {"cold": {"capacity": {"rate": 3.0},
                                                                 "points": [{
            "kind": "rate", "result": {"server_stages_ms": stages}}]}}})
    upgraded = load_result(sweep)["phases"]["cold"]
    point = upgraded["points"][0]
    assert set(point["result"]["server_stages_ms"]) == {"decode_ms", "processor_ms"}
    # version 1's capacity was an offered rate: the gate will not compare it with a
    # sustained one (an unchanged server would look slower)
    assert upgraded["capacity"] == {"rate": 3.0, "definition": "offered"}
    from aphrodite_cli.bench.results.gate import compare_capacity

    with pytest.raises(ConfigError, match="offered rate") as info:
        compare_capacity([sweep], [sweep])
    assert "run bench sweep again" in info.value.hint
    # a version this code never wrote is still refused by name
    future = _write(tmp_path / "serve-new.json", {"schema_version": 3, "kind": "serve",
                                                  "phases": {}})
    with pytest.raises(ConfigError, match="schema version 3"):
        load_result(future)


def test_the_prefix_cache_share_is_summed_from_usage_and_validated(tmp_path):
    records = [RequestRecord(i, ok=True, ttft=0.1, e2e=0.5, output_tokens=2, prompt_tokens=100,
                             cached_tokens=cached) for i, cached in enumerate((0, 96))]
    summary = compute(records, 1.0)["prefix_cache"]
    assert summary == {"cached_tokens": 96, "prompt_tokens": 200, "hit_rate": 0.48}
    assert compute([], 1.0)["prefix_cache"]["hit_rate"] is None  # nothing reported
    bad = _write(tmp_path / "serve-bad.json", {
        "schema_version": 2, "kind": "serve", "phases": {"warm": {
            "samples": {}, "prefix_cache": {"hit_rate": "most"}}}})
    with pytest.raises(ConfigError) as info:
        load_result(bad)
    assert "phases.warm.prefix_cache.hit_rate" in info.value.message


def test_token_throughputs_ttst_and_per_user_speed_from_a_hand_computed_trace():
    """Two answers over a 2 s phase: 100 + 50 prompt tokens (usage) and 5 + 3 output tokens;
    input 75 tok/s, total (150 + 8) / 2 = 79 tok/s; TTST is each answer's first gap (0.02,
    0.04 s); tokens/s per user is (n - 1) / (E2E - TTFT): 4 / 0.4 = 10 and 2 / 0.1 = 20."""
    records = [RequestRecord(0, ok=True, ttft=0.1, e2e=0.5, output_tokens=5, prompt_tokens=100,
                             itl=[0.02, 0.1, 0.1, 0.18], token_source="usage"),
               RequestRecord(1, ok=True, ttft=0.2, e2e=0.3, output_tokens=3, prompt_tokens=50,
                             itl=[0.04, 0.06], token_source="usage"),
               RequestRecord(2, error="http_500", prompt_tokens=999)]  # failed: not counted
    m = compute(records, 2.0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (150, 8)
    assert m["input_token_throughput"] == pytest.approx(75.0)
    assert m["total_token_throughput"] == pytest.approx(79.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["ttst_ms"]["count"] == 2 and m["ttst_ms"]["median"] == pytest.approx(30.0)
    per_user = m["output_token_throughput_per_user"]
    assert (per_user["min"], per_user["max"]) == (pytest.approx(10.0), pytest.approx(20.0))
    assert per_user["median"] == pytest.approx(15.0)
    # one completed answer without usage: the prompt tokens are unknown, not 0 tok/s
    records[1].token_source = "stream chunks"
    m = compute(records, 2.0)
    assert m["total_input_tokens"] is None and m["total_token_throughput"] is None
    assert m["input_token_throughput"] is None and m["output_throughput"] == pytest.approx(4)


@pytest.mark.parametrize(("field", "named"), [
    ({"total_token_throughput": "fast"}, "phases.cold.total_token_throughput"),
    ({"input_token_throughput": [1]}, "phases.cold.input_token_throughput"),
    ({"ttst_ms": {"median": "soon"}}, "phases.cold.ttst_ms.median"),
    ({"output_token_throughput_per_user": {"p99": "x"}},
     "phases.cold.output_token_throughput_per_user.p99"),
    ({"cancelled": "some"}, "phases.cold.cancelled"),
])
def test_the_new_metrics_are_validated_by_field(tmp_path, field, named):
    bad = _write(tmp_path / "serve-bad.json", {"schema_version": 2, "kind": "serve",
                                               "phases": {"cold": {"samples": {}, **field}}})
    with pytest.raises(ConfigError) as info:
        load_result(bad)
    assert named in info.value.message, info.value.message


def test_a_result_written_before_the_new_metrics_still_loads(tmp_path):
    old = _write(tmp_path / "serve-old.json", {"schema_version": 2, "kind": "serve",
                                               "phases": {"cold": {"samples": {}}}})
    assert load_result(old)["phases"]["cold"]["samples"] == {}


def test_the_gate_judges_ttst_and_per_user_speed_higher_is_better(tmp_path):
    """The gate's metric list holds both; a candidate whose users read 20% slower regresses
    (higher is better), one whose TTST is 20% shorter improved."""
    from aphrodite_cli.bench.results.gate import DEFAULT_METRICS, compare

    assert {"ttst_ms", "output_token_throughput_per_user"} <= set(DEFAULT_METRICS)

    def doc(name: str, speed: float, ttst: float):
        rng = np.random.default_rng(len(name))
        return _write(tmp_path / name, {"schema_version": 2, "kind": "serve", "phases": {
            "cold": {"samples": {
                "output_token_throughput_per_user": list(speed * rng.uniform(0.98, 1.02, 60)),
                "ttst_ms": list(ttst * rng.uniform(0.98, 1.02, 60))}}}})

    verdicts = {v.metric: v for v in compare([doc("a.json", 100.0, 20.0)],
                                             [doc("b.json", 80.0, 16.0)])}
    speed, ttst = verdicts["output_token_throughput_per_user"], verdicts["ttst_ms"]
    assert speed.regressed and not speed.improved
    assert ttst.improved and not ttst.regressed
