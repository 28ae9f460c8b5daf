"""``serve --data-parallel-size auto`` and the thread defaults: the rule (engine.cpus.
auto_parallel) by model size and CPUs, the checkpoint's parameter count read from its
safetensors headers without loading it, and what the launcher starts from both (an explicit
count or --num-threads stays); model-free."""

from __future__ import annotations

import json
import struct

import pytest

from engine.config import EngineConfig, ParallelConfig
from engine.cpus import ONE_THREAD_PARAMETERS, auto_parallel
from engine.errors import ConfigError
from engine.models.checkpoint import parameters
from engine.server.process.parallel_defaults import engines_and_threads


@pytest.mark.parametrize(("params", "cpus", "want"), [
    (186_656, 2, (1, 1)),  # tiny: one engine, one thread
    (186_656, 16, (1, 1)),
    (ONE_THREAD_PARAMETERS - 1, 2, (1, 1)),
    (ONE_THREAD_PARAMETERS, 2, (1, None)),
    (42_841_656, 2, (1, None)),  # small: one engine on both cores (1.03-1.34x two engines)
    (42_841_656, 1, (1, None)),
    (42_841_656, 8, (1, None)),
    (151_544_832, 2, (1, None)),  # medium: the same (1.0-1.7x two engines)
    (1_500_000_000, 16, (1, None)),  # a real model: one engine on every CPU
    (7_000_000_000, 64, (1, None)),
    (None, 2, (1, None)),  # unknown size: the plain defaults
])
def test_the_rule_by_model_size_and_cpus(params, cpus, want):
    assert auto_parallel(params, cpus) == want


def _safetensors(path, shapes: dict, header_size: int | None = None) -> None:
    header = {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
              for name, shape in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_size or len(raw)) + raw)


def test_the_parameter_count_comes_from_every_safetensors_header(tmp_path):
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [3, 4], "b": [5]})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [2, 2, 2], "d": []})
    assert parameters(tmp_path) == 12 + 5 + 8 + 1


@pytest.mark.parametrize("damage", ["none", "truncated", "huge header", "not json"])
def test_an_unreadable_checkpoint_counts_as_unknown(tmp_path, damage):
    file = tmp_path / "model.safetensors"
    if damage == "truncated":
        file.write_bytes(b"\x01\x02")
    elif damage == "huge header":
        _safetensors(file, {"a": [1]}, header_size=1 << 40)
    elif damage == "not json":
        file.write_bytes(struct.pack("<Q", 3) + b"{x}")
    assert parameters(tmp_path) is None


def test_auto_starts_what_the_rule_says_and_given_settings_stay(tmp_path):
    small, tiny = tmp_path / "small", tmp_path / "tiny"
    small.mkdir()
    tiny.mkdir()
    _safetensors(small / "model.safetensors", {"w": [40_000_000]})
    _safetensors(tiny / "model.safetensors", {"w": [400_000]})
    auto, plain = ParallelConfig(data_parallel_size="auto"), EngineConfig()
    assert auto.data_parallel_count is None and ParallelConfig() == auto  # auto by default
    count, engine = engines_and_threads(auto, plain, small, cpus=2)
    assert (count, engine.num_threads) == (1, None)  # one engine on every CPU
    count, engine = engines_and_threads(auto, plain, tiny, cpus=2)
    assert (count, engine.num_threads) == (1, 1)
    count, engine = engines_and_threads(auto, EngineConfig(num_threads=2), tiny, cpus=2)
    assert (count, engine.num_threads) == (1, 2)  # --num-threads given: it stays
    count, engine = engines_and_threads(ParallelConfig(data_parallel_size=1), plain, small, cpus=2)
    assert (count, engine.num_threads) == (1, None)  # a count given: as before
    count, engine = engines_and_threads(ParallelConfig(data_parallel_size=2), plain, small, cpus=4)
    assert (count, engine.num_threads) == (2, 2)
    count, engine = engines_and_threads(auto, EngineConfig(device="cuda"), tiny, cpus=2)
    assert (count, engine.num_threads) == (1, None)  # a GPU: one engine
    count, engine = engines_and_threads(auto, plain, tmp_path / "absent", cpus=2)
    assert (count, engine.num_threads) == (1, None)  # no checkpoint to read


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "two", "AUTO"])
def test_a_bad_data_parallel_size_is_a_config_error_naming_auto(value):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(data_parallel_size=value)
    assert "--data-parallel-size" in info.value.message and "auto" in info.value.hint


def test_the_flag_takes_a_count_or_auto():
    import typer

    from aphrodite_cli.serve import parse_data_parallel

    assert parse_data_parallel("auto") == "auto" and parse_data_parallel("3") == 3
    for bad in ("0", "-2", "x", "1.5", ""):
        with pytest.raises(typer.BadParameter, match="auto"):
            parse_data_parallel(bad)


def test_vllm_runs_one_rank_for_auto():
    from engine.server.config import ServerConfig
    from engine.server.vllm_adapter.vllm_spec import engine_args

    args = engine_args(ServerConfig(engine_kind="vllm", parallel=ParallelConfig(
        data_parallel_size="auto")), "/models/m", "m")
    assert args["data_parallel_size"] == 1
