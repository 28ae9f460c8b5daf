"""The batching engine: one thread owns the model; requests that arrive while it works are
batched into its next forward passes (up to ``max_batch_size`` sequences)."""

from __future__ import annotations

import queue
import threading
import time

from engine.errors import AphroditeError, InternalError
from engine.executor.request import EngineRequest
from engine.executor.runner import TransformersRunner
from engine.models.loader import LoadedModel


class Engine:
    """Owns a :class:`TransformersRunner` and a queue; ``submit`` is thread-safe."""

    def __init__(self, loaded: LoadedModel, *, device: str = "cpu", dtype: str = "auto",
                 max_batch_size: int = 8, batch_wait_s: float = 0.005) -> None:
        self.runner = TransformersRunner(loaded, device, dtype)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._queue: queue.Queue[EngineRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="aphrodite-engine", daemon=True)
        self._thread.start()
        self.batches = 0

    def submit(self, request: EngineRequest) -> EngineRequest:
        self._queue.put(request)
        return request

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while self._serve_one():
            pass

    def _serve_one(self) -> bool:
        """Wait for work and run one batch. A method of its own so that the batch's requests
        are not left bound to the loop's locals while the thread waits for the next one."""
        batch = self._next_batch()
        if batch is None:
            return False
        live = [r for r in batch if not r.cancelled.is_set()]
        for r in batch:
            if r.cancelled.is_set():
                r.finish()
        if not live:
            return True
        try:
            self.batches += 1
            self.runner.run(live)
        except AphroditeError as err:
            for r in live:
                r.error = err
        except Exception as exc:  # a bug: reported per request, the engine keeps going
            for r in live:
                r.error = InternalError(f"generation failed: {type(exc).__name__}")
        finally:
            for r in live:
                r.finish()
        return True

    def _next_batch(self) -> list[EngineRequest] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        rows = first.params.n
        deadline = time.perf_counter() + self.batch_wait_s
        while rows < self.max_batch_size:
            try:
                nxt = self._queue.get(timeout=max(deadline - time.perf_counter(), 0))
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            if rows + nxt.params.n > self.max_batch_size:
                self._queue.put(nxt)  # next batch
                break
            batch.append(nxt)
            rows += nxt.params.n
        return batch
