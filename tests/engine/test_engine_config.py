"""The engine's settings are one frozen, checked object: a bad value is a ConfigError naming its
flag wherever it enters (``serve``'s flags, ``LLM(...)``), never a silent default, and the CLI's
defaults are the object's own."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from engine.config import EngineConfig, ParallelConfig, PipelineConfig, VllmConfig
from engine.errors import ConfigError
from engine.server.config import ServerConfig


@pytest.mark.parametrize(("settings", "flag"), [
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_seqs": -3}, "--max-num-seqs"),
    ({"max_num_seqs": True}, "--max-num-seqs"),
    ({"max_num_seqs": 2.5}, "--max-num-seqs"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ({"num_threads": 0}, "--num-threads"),
    ({"dtype": "float8"}, "--dtype"),
    ({"device": "tpu"}, "--device"),
    ({"device": "cpu:1"}, "--device"),
    ({"device": "cuda:x"}, "--device"),
    ({"scheduling": "eager"}, "scheduling"),
    ({"reserved_gpu_bytes": -1}, "--mm-ipc-gpu-memory-gb"),
    ({"prefix_cache_gb": -0.5}, "--prefix-cache-gb"),
    ({"prefix_cache_gb": float("nan")}, "--prefix-cache-gb"),
    ({"encoder_cache_gb": "1"}, "--encoder-cache-gb"),
    ({"enable_prefix_caching": "yes"}, "--enable-prefix-caching"),
    ({"block_size": 0}, "--block-size"),
])
def test_a_bad_engine_setting_is_a_config_error_naming_its_flag(settings, flag):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**settings)
    assert flag in str(info.value)
    assert repr(next(iter(settings.values()))) in info.value.message


def test_llm_refuses_max_num_seqs_0_before_loading_anything():
    """``LLM(max_num_seqs=0)`` used to become 8 (``max_num_seqs or max_batch_size``)."""
    from engine import LLM

    with pytest.raises(ConfigError) as info:
        LLM("/no/such/model", max_num_seqs=0)  # the model is never looked for
    assert "--max-num-seqs" in info.value.message and "0" in info.value.message
    with pytest.raises(ConfigError) as info:
        LLM("/no/such/model", max_num_sequences=4)
    assert "max_num_sequences" in info.value.message and "max_num_seqs" in info.value.hint


def test_the_config_is_frozen_and_crosses_a_process_boundary_whole():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, scheduling="static",
                          device="cuda:1", dtype="bfloat16", num_threads=2,
                          reserved_gpu_bytes=1 << 30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 4  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config
    server = ServerConfig(engine=config)
    assert pickle.loads(pickle.dumps(server)).engine == config


def test_serve_flag_defaults_are_the_config_defaults():
    """Each of ``serve``'s defaults is written once, in the dataclass its value goes to."""
    from aphrodite_cli.serve import serve

    owners = {f.name: (cls, f) for cls in (ServerConfig, PipelineConfig, EngineConfig,
                                           ParallelConfig, VllmConfig)
              for f in dataclasses.fields(cls)}
    checked = 0
    for name, param in inspect.signature(serve).parameters.items():
        if name not in owners or name == "model":
            continue
        cls, f = owners[name]
        assert param.default == f.default, (name, cls.__name__)
        checked += 1
    assert checked >= 35
    assert not {f.name for f in dataclasses.fields(EngineConfig)} & {
        f.name for f in dataclasses.fields(ServerConfig)}  # one home per setting


def test_serve_refuses_max_num_seqs_0_in_one_line():
    import subprocess

    from tests.server_harness import BIN, free_port

    done = subprocess.run([str(BIN), "serve", "--max-num-seqs", "0", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--max-num-seqs must be a whole number of at least 1, not 0" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_engine_sets_its_thread_count():
    """``--num-threads`` (and ``LLM(num_threads=...)``) reach torch in the engine's process."""
    import torch

    from engine.executor.engine import Engine
    from tests.engine_fixtures import llm

    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    engine = Engine(llm("qwen2_5_vl").loaded, EngineConfig(num_threads=want))
    try:
        assert torch.get_num_threads() == want
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_without_num_threads_the_engine_uses_the_cpus_the_process_may_use():
    """No ``--num-threads``: torch gets the process's CPU affinity (what ``taskset`` and
    container cpusets allow), not the machine's core count."""
    import os

    import torch

    from engine.cpus import usable_cpus
    from engine.executor.engine import Engine
    from tests.engine_fixtures import llm

    before = torch.get_num_threads()
    allowed = os.sched_getaffinity(0)
    torch.set_num_threads(len(allowed) + 3)  # a wrong count the engine must replace
    try:
        engine = Engine(llm("qwen2_5_vl").loaded, EngineConfig())
        try:
            assert torch.get_num_threads() == usable_cpus() <= len(allowed)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)


def test_usable_cpus_follow_affinity_and_a_cgroup_quota(tmp_path):
    """The affinity mask counts; a cgroup v2 ``cpu.max`` quota lowers it (rounded up);
    ``max`` or an unreadable file leaves it."""
    import os

    from engine.cpus import quota_cpus, usable_cpus

    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert usable_cpus(cpu_max) == affinity  # no file
    cpu_max.write_text("max 100000\n")
    assert quota_cpus(cpu_max) is None and usable_cpus(cpu_max) == affinity
    cpu_max.write_text("150000 100000\n")
    assert quota_cpus(cpu_max) == 2 and usable_cpus(cpu_max) == min(affinity, 2)
    cpu_max.write_text("50000 100000\n")
    assert usable_cpus(cpu_max) == 1
    cpu_max.write_text("garbage\n")
    assert quota_cpus(cpu_max) is None
