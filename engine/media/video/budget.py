"""The GPU decode budget (``--mm-ipc-gpu-memory-gb``).

The total is divided evenly among the API server processes (``--api-server-count``). A GPU
decode reserves its frames' bytes from its process's share before it allocates, waits first
come first served while the share is exhausted, and releases on completion or error. One item
larger than a whole share can never fit: that is a client error naming the flag. The engine
subtracts :attr:`GpuDecodeBudget.reserved_total_bytes` from the memory it plans for itself.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.errors import ConfigError, MediaTooLargeError

GIB = 1 << 30


class GpuDecodeBudget:
    """One API server process's share of the GPU decode budget."""

    def __init__(self, total_bytes: int, api_server_count: int = 1) -> None:
        if api_server_count < 1:
            raise ConfigError(f"--api-server-count {api_server_count} must be at least 1")
        if total_bytes <= 0:
            raise ConfigError("the GPU decode budget must be positive",
                              hint="set --mm-ipc-gpu-memory-gb to a positive number of GB")
        self.reserved_total_bytes = total_bytes
        self.api_server_count = api_server_count
        self.share_bytes = total_bytes // api_server_count
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @classmethod
    def from_gb(cls, gb: float, api_server_count: int = 1) -> GpuDecodeBudget:
        return cls(int(gb * GIB), api_server_count)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, nbytes: int) -> bool:
        return self.in_use + nbytes <= self.share_bytes

    def _wake(self) -> None:
        # Strict first come first served: only the head of the queue may take bytes.
        while self._waiters:
            nbytes, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self.in_use += nbytes
            fut.set_result(None)

    async def acquire(self, nbytes: int) -> None:
        if nbytes > self.share_bytes:
            raise MediaTooLargeError(
                f"decoding this video needs {nbytes} bytes of GPU memory, more than this "
                f"server process's share of the decode budget ({self.share_bytes} bytes = "
                f"--mm-ipc-gpu-memory-gb / --api-server-count {self.api_server_count})",
                hint="ask for fewer or smaller frames, or raise --mm-ipc-gpu-memory-gb",
                code="gpu_decode_budget_exceeded")
        if not self._waiters and self._fits(nbytes):
            self.in_use += nbytes
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(nbytes)  # granted just as we were cancelled: give it back
            self._wake()
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._wake()

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the share for the block; released on exit, error or not."""
        await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)
