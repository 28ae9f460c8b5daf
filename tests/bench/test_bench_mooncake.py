"""Mooncake traces (``--dataset-name mooncake`` / vLLM's ``timed_trace``): equal hash ids are
equal token blocks, prompts are ``input_length`` tokens, requests leave at the trace's times
scaled by ``--trace-time-scale`` (or vLLM's ``--timed-trace-sec-multiplier``), and a hostile
trace is a one-line error naming its line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aphrodite_cli.bench.load.mooncake import load_mooncake
from aphrodite_cli.bench.load.token_prompts import TokenPrompts
from engine.errors import ConfigError

TRACE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 1400, "input_length": 600, "output_length": 2, "hash_ids": [1, 9]},
    {"timestamp": 1200, "input_length": 512, "output_length": 4, "hash_ids": [1]},
]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_equal_hash_ids_are_equal_token_blocks_at_the_traces_times(tiny_tokenizer, tmp_path):
    prompts = TokenPrompts.build(tiny_tokenizer, chat=False)
    reqs = load_mooncake(_write(tmp_path / "t.jsonl", TRACE), prompts, limit=10, seed=0,
                         nonce=1, seconds_per_unit=0.001 * 0.5)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.1, 0.2])  # sorted, scaled
    assert [r.output_len for r in reqs] == [3, 4, 2]
    ids = [tiny_tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in reqs]
    assert [len(i) for i in ids] == [1100, 512, 600] == [r.input_len for r in reqs]
    assert ids[0][:512] == ids[1] == ids[2][:512]  # hash id 1 everywhere
    assert ids[0][512:1024] != ids[2][512:1024][:512]  # ids 2 and 9 differ
    again = load_mooncake(tmp_path / "t.jsonl", prompts, limit=10, seed=0, nonce=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    cold = load_mooncake(tmp_path / "t.jsonl", prompts, limit=10, seed=0, nonce=2)
    assert cold[0].prompt != reqs[0].prompt  # another run's cold phase: new blocks
    small = load_mooncake(_write(tmp_path / "s.jsonl", [
        {"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [5, 6, 7]}]),
        prompts, block=16, limit=1, seed=0, nonce=0)
    assert len(tiny_tokenizer(small[0].prompt, add_special_tokens=False)["input_ids"]) == 40


@pytest.mark.parametrize(("line", "says"), [
    ("{not json", "is not JSON"),
    ("[1, 2]", "is not a JSON object"),
    ({"timestamp": True, "input_length": 1, "output_length": 1, "hash_ids": [1]},
     "timestamp is a number"),
    ({"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
     "timestamp is a number"),
    ({"timestamp": 0, "input_length": 10**12, "output_length": 1, "hash_ids": [1]},
     "input_length and output_length are integers"),
    ({"timestamp": 0, "input_length": 5, "output_length": "9", "hash_ids": [1]},
     "input_length and output_length are integers"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]},
     "hash_ids is a list"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1"},
     "hash_ids is a list"),
    ({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]},
     "input_length 1100 is 3 blocks of 512 tokens, but hash_ids holds 1"),
])
def test_a_hostile_trace_line_is_a_one_line_error_naming_it(tiny_tokenizer, tmp_path, line, says):
    prompts = TokenPrompts.build(tiny_tokenizer, chat=False)
    path = _write(tmp_path / "bad.jsonl", [TRACE[0], line])
    with pytest.raises(ConfigError) as info:
        load_mooncake(path, prompts, limit=10, seed=0, nonce=0)
    assert says in info.value.message and f"{path}:2" in info.value.message
    assert "\n" not in info.value.message
    if "blocks of" in says:
        assert "--timed-trace-chunk-hash-size" in info.value.hint


def test_a_trace_whose_replay_would_never_end_is_refused(tiny_tokenizer, tmp_path):
    """A finite timestamp 10^15 ms after the first is a replay of 31,000 years: named, with
    the flags that scale time, before any request is sent."""
    prompts = TokenPrompts.build(tiny_tokenizer, chat=False)
    far = {**TRACE[0], "timestamp": 1e15}
    path = _write(tmp_path / "far.jsonl", [TRACE[0], far])
    with pytest.raises(ConfigError, match="past the cap of 604800 s") as info:
        load_mooncake(path, prompts, limit=10, seed=0, nonce=0)
    assert "time scale" in info.value.hint


def test_the_command_replays_a_mooncake_trace_on_its_schedule(tmp_path, tiny_tokenizer_dir):
    """Against the mock (its own process): vLLM's spelling, timed_trace with
    --timed-trace-sec-multiplier 0.0005 (the trace at twice its speed), sends each request at
    its time: 0, 100 and 200 ms after the first."""
    from tests.server_harness import free_port, wait_exit, wait_listening

    port = free_port()
    exe = Path(sys.executable).with_name("aphrodite")
    mock = subprocess.Popen([str(exe), "bench", "mock-server", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        mock.stdout.readline()
        wait_listening(port)
        trace = _write(tmp_path / "trace.jsonl", TRACE)
        done = subprocess.run(
            [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--backend",
             "openai", "--dataset-name", "timed_trace", "--dataset-path", str(trace),
             "--timed-trace-sec-multiplier", "0.0005", "--tokenizer", tiny_tokenizer_dir,
             "--mode", "cold", "--num-warmups", "0", "--out-dir", str(tmp_path),
             "--result-filename", "m.json"],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        bad = subprocess.run(
            [str(exe), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--dataset-name", "mooncake", "--dataset-path", str(trace), "--trace-time-scale",
             "2", "--timed-trace-sec-multiplier", "0.001"], capture_output=True, text=True,
            timeout=60)
    finally:
        mock.terminate()
        wait_exit(mock, 30)
    doc = json.loads((tmp_path / "m.json").read_text())
    rows = doc["requests"]["cold"]
    assert [r["input_len"] for r in rows] == [1100, 512, 600]
    assert [r["sent_ms"] for r in rows] == pytest.approx([0, 100, 200], abs=30)
    assert doc["input_tokens"]["block_tokens"] == 512
    assert doc["input_tokens"]["seconds_per_timestamp_unit"] == 0.0005
    said = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "Traceback" not in said and "pass one of them" in said, said
