"""The engine process of ``serve --engine vllm``: :mod:`engine.vllm_bridge` run by vLLM's
own interpreter (see :mod:`engine.server.vllm_adapter.vllm_spec`), looking to the supervisor like
the
``multiprocessing.Process`` of ``--engine aphrodite``: ``exitcode``, ``join``,
``terminate``, ``kill``, and a ready pipe that yields its pid once it accepts API servers."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from typing import Any

from engine.config import VLLM_CPU_KV_CACHE_DEFAULT_BYTES
from engine.errors import ConfigError
from engine.server.vllm_adapter.vllm_spec import bridge_env, engine_args, find_python
from engine.server.vllm_adapter.vllm_startup import RefusalWatch


class ReadyPipe:
    """The read end of the bridge's ready line (its pid): ``recv`` gives what our engine
    process sends, its pid and its settings line (none from vLLM's bridge)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""

    def poll(self, timeout: float) -> bool:
        if b"\n" in self.data:
            return True
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            chunk = os.read(self.fd, 64)
            self.data += chunk
        return b"\n" in self.data

    def recv(self) -> tuple[int, str | None]:
        return int(self.data.split(b"\n", 1)[0]), None

    def close(self) -> None:
        os.close(self.fd)


class VllmEngineProcess:
    """The bridge as a child process of the supervisor (same process group: a signal to the
    server's group reaches it; it also exits when the supervisor dies)."""

    name = "engine process (vLLM)"

    def __init__(self, config: Any, model_path: str, served_name: str, address: str,
                 authkey: bytes) -> None:
        python = find_python(config.vllm.python)
        read, write = os.pipe()
        spec = {"address": address, "authkey": authkey.hex(), "ready_fd": write,
                "api_servers": config.api_server_count,
                "reserved_gpu_bytes": int(config.mm_ipc_gpu_memory_gb * (1 << 30)),
                "engine_args": engine_args(config, model_path, served_name),
                "cpu_kv_cache_bytes": VLLM_CPU_KV_CACHE_DEFAULT_BYTES}
        # vLLM's own temporary files (its engine's IPC sockets, its workers' rendezvous file)
        # go in the server's private folder, which the supervisor removes however it stops
        scratch = os.path.join(os.path.dirname(address), "vllm-tmp")
        os.makedirs(scratch, mode=0o700, exist_ok=True)
        env = {**bridge_env(python), "TMPDIR": scratch}
        self.proc = subprocess.Popen([str(python), "-m", "engine.vllm_bridge"],
                                     stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=(write,), env=env)
        # (its stderr passed on, and read for vLLM's start-up refusals)
        self.watch = RefusalWatch(self.proc.stderr) if self.proc.stderr else None
        os.close(write)
        self.ready = ReadyPipe(read)
        stdin = self.proc.stdin  # (a pipe: Popen was asked for one)
        if stdin is not None:
            # (one that exits before it reads is reported by the launcher as an exit)
            with contextlib.suppress(BrokenPipeError):
                stdin.write(json.dumps(spec).encode() + b"\n")
            with contextlib.suppress(BrokenPipeError):
                stdin.close()

    @property
    def refusal(self) -> ConfigError | None:
        """vLLM's start-up refusal as a one-line error naming our flag (once it exited)."""
        if self.watch is None:
            return None
        self.watch.thread.join(2)  # (its last lines, written as it exited)
        return self.watch.refusal

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
