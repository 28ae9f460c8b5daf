"""vLLM's start-up refusals as one-line errors naming this server's flag.

vLLM's engine core runs in a process of its own, so the bridge sees only "Engine core
initialization failed"; the reason is a line that process writes to its stderr. The bridge's
stderr (which its children share) is read here, passed on as it is, and scanned for the
refusals a user can fix with a flag: vLLM's CPU worker wants ``--gpu-memory-utilization``
(0.9) of the machine's memory free at start unless the KV cache has a size of its own, and
refuses a KV cache larger than the memory free. Stdlib only.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import IO

from engine.errors import ConfigError

FLAG = "--kv-cache-memory-bytes"
#: "Available memory on node 0 (20.66/23.54 GiB)"
_FREE = re.compile(r"Available memory on node \d+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\)")
#: the worker's words for each refusal (vllm/v1/worker/cpu_worker.py, vLLM 0.32)
_UTILIZATION = "is less than desired CPU memory utilization"
_KV_TOO_BIG = "is less than requested memory for kv"


def startup_refusal(line: str) -> ConfigError | None:
    """The :class:`ConfigError` for a line of vLLM's output that is one of its memory
    refusals at start-up, naming --kv-cache-memory-bytes; None for any other line."""
    found = _FREE.search(line)
    if found is None or not (_UTILIZATION in line or _KV_TOO_BIG in line):
        return None
    free = f"{found['free']} of {found['total']} GiB free"
    if _UTILIZATION in line:
        return ConfigError(
            f"vLLM's CPU worker would not start with {free}: without a KV cache size it "
            "wants --gpu-memory-utilization of the machine's memory free", code="vllm_memory",
            hint=f"give vLLM's KV cache a size with {FLAG} (e.g. 4G), or free memory")
    return ConfigError(f"vLLM's KV cache does not fit this machine's memory ({free})",
                       code="vllm_memory",
                       hint=f"lower {FLAG} (e.g. 1G; VLLM_CPU_KVCACHE_SPACE, when set, wins "
                            "over it), or free memory")


class RefusalWatch:
    """Reads a child's stderr on a thread, writes each line on to ``out`` and keeps the first
    :func:`startup_refusal` it meets (``refusal``)."""

    def __init__(self, stream: IO[bytes], out: IO[str] | None = None) -> None:
        self.refusal: ConfigError | None = None
        self._stream, self._out = stream, out
        self.thread = threading.Thread(target=self._pump, daemon=True,
                                       name="vllm-stderr")
        self.thread.start()

    def _pump(self) -> None:
        out = self._out or sys.stderr
        for raw in iter(self._stream.readline, b""):
            line = raw.decode(errors="replace")
            if self.refusal is None:
                self.refusal = startup_refusal(line)
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):  # (our stderr closed: keep draining the pipe)
                pass
