"""The engine processes the supervisor starts, chosen once from ``--engine``
(:func:`engines_for`): what differs between this project's engine and vLLM's in checking the
flags, placing the model, fitting the length, starting and stopping them. (The API server's
side of the same choice: :mod:`engine.server.api.backend`.)

- :class:`OursEngines` (``--engine aphrodite``): ``--data-parallel-size`` engine processes of
  this project, each on its own slice of the CPUs.
- :class:`VllmEngines` (``--engine vllm``): one vLLM engine process in vLLM's environment
  (which runs its own data-parallel ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.server.config import ServerConfig

#: one started engine: its process, the pipe it reports on once it accepts API servers, its
#: socket's path and the CPUs it is pinned to (None: not)
Started = tuple[Any, Any, str, list[int] | None]


def check_device(device: str) -> None:
    """``--device`` cuda or cuda:N exists here (its form and ``--dtype`` were checked when the
    flags became an :class:`~engine.config.EngineConfig`)."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) >= count:
            raise ConfigError(f"--device {device}: this machine has "
                              f"{count or 'no'} CUDA device{'s' if count != 1 else ''}",
                              hint="use --device cpu, or run on a machine with an NVIDIA GPU",
                              code="invalid_device")


class OursEngines:
    """``--engine aphrodite``."""

    kind = "aphrodite"
    #: seconds the engines have to exit on SIGTERM before they are killed
    stop_grace_s = 5.0

    def check_flags(self, config: ServerConfig) -> None:
        """This project's engine runs data-parallel copies on one machine's CPUs; model
        sharding and several copies on one GPU are vLLM's."""
        parallel = config.parallel
        for flag, value in (("--tensor-parallel-size", parallel.tensor_parallel_size),
                            ("--pipeline-parallel-size", parallel.pipeline_parallel_size)):
            if value != 1:
                raise ConfigError(f"{flag} {value}: this project's engine runs the whole model in "
                                  "one process", hint="add --engine vllm to split the model "
                                  "across GPUs", code="invalid_flag")
        if config.vllm.enforce_eager and config.engine.compile_decode:
            raise ConfigError("--enforce-eager with --compile-decode: one says to compile the "
                              "decode step, the other not to", hint="leave one out (this "
                              "project's engine is eager without --compile-decode)",
                              code="invalid_flag")
        if (parallel.data_parallel_count or 1) > 1 and str(config.engine.device) != "cpu":
            raise ConfigError(f"--data-parallel-size {parallel.data_parallel_size} on "
                              f"--device {config.engine.device}: this project's engine runs its "
                              "copies on the CPU", hint="add --engine vllm for model replicas on "
                              "GPUs, or serve with --device cpu", code="invalid_flag")

    def check_device(self, config: ServerConfig) -> None:
        check_device(config.engine.device)

    def fit(self, config: ServerConfig, model_path: str, announce: Any) -> ServerConfig:
        return config

    def start(self, config: ServerConfig, ctx: Any, model_path: str, name: str, folder: Path,
              authkey: bytes) -> list[Started]:
        """``--data-parallel-size`` engine processes, each on its own slice of the CPUs
        (:func:`engine.cpus.engine_share`) with an even share of torch threads by default;
        each sends ``(pid, its settings line)`` down its pipe once it accepts API servers."""
        from dataclasses import replace

        from engine.cpus import engine_share
        from engine.server.process.engine_proc import serve_engine
        from engine.server.process.parallel_defaults import engines_and_threads

        engine_config = replace(config.engine,
                                reserved_gpu_bytes=int(config.mm_ipc_gpu_memory_gb * (1 << 30)))
        count, engine_config = engines_and_threads(config.parallel, engine_config, Path(model_path))
        started = []
        for index in range(count):
            cpus = engine_share(index, count)
            address = str(folder / (f"engine-{index}.sock" if count > 1 else "engine.sock"))
            ready, ready_child = ctx.Pipe(duplex=False)
            engine = ctx.Process(
                target=serve_engine, name=f"engine process {index}" if count > 1
                else "engine process", daemon=False, kwargs=dict(
                    address=address, authkey=authkey, model=model_path,
                    chat_template=config.chat_template, config=engine_config, ready=ready_child,
                    api_servers=config.api_server_count, cpus=cpus))
            engine.start()
            ready_child.close()
            started.append((engine, ready, address, cpus))
        return started


class VllmEngines:
    """``--engine vllm``."""

    kind = "vllm"
    stop_grace_s = 20.0

    def check_flags(self, config: ServerConfig) -> None:
        """No flag of this project's engine (it would be silently ignored), and vLLM's
        environment is there (or how to build it)."""
        from engine.server.vllm_adapter.vllm_spec import find_python, ours_only_flags

        for flag, instead in ours_only_flags(config.engine):
            raise ConfigError(f"{flag} sets this project's engine and has no effect with "
                              f"--engine vllm", hint=f"leave it out; {instead}",
                              code="invalid_flag")
        find_python(config.vllm.python)

    def check_device(self, config: ServerConfig) -> None:
        """vLLM places its model itself."""

    def fit(self, config: ServerConfig, model_path: str, announce: Any) -> ServerConfig:
        """vLLM refuses a --max-model-len over the model's own limit: the server's length (the
        default 8192 included) is capped there, for vLLM and the API servers alike, and said
        so."""
        from dataclasses import replace

        from engine.server.vllm_adapter.vllm_spec import model_max_len

        limit = model_max_len(model_path)
        if limit is None or config.max_model_len <= limit:
            return config
        announce(f"--max-model-len {config.max_model_len} is over the model's "
                 f"max_position_embeddings {limit}: serving with --max-model-len {limit}")
        return replace(config, max_model_len=limit)

    def start(self, config: ServerConfig, ctx: Any, model_path: str, name: str, folder: Path,
              authkey: bytes) -> list[Started]:
        """vLLM's engine process (:mod:`engine.server.vllm_adapter.vllm_process`: AsyncLLM in
        vLLM's own environment) and the pipe it sends its pid down once it accepts API
        servers; it leaves the API servers' video decode budget (``--mm-ipc-gpu-memory-gb``)
        free on the GPU."""
        from engine.server.vllm_adapter.vllm_process import VllmEngineProcess

        address = str(folder / "engine.sock")
        engine = VllmEngineProcess(config, model_path, name, address, authkey)
        return [(engine, engine.ready, address, None)]


def engines_for(config: ServerConfig) -> OursEngines | VllmEngines:
    """The engines for ``--engine``; any other name is a flag error."""
    if config.engine_kind == "vllm":
        return VllmEngines()
    if config.engine_kind == "aphrodite":
        return OursEngines()
    raise ConfigError(f"--engine {config.engine_kind!r} is not supported",
                      hint="use aphrodite or vllm", code="invalid_flag")
