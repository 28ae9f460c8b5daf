"""The batching engine: one thread owns the model; requests that arrive while it works are
batched into its next forward passes (up to ``max_batch_size`` sequences)."""

from __future__ import annotations

import logging
import queue
import threading
import time

from engine.errors import AphroditeError, InternalError
from engine.executor.request import EngineRequest
from engine.executor.runner import TransformersRunner
from engine.models.loader import LoadedModel

logger = logging.getLogger("aphrodite.engine")


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
        except Exception as exc:
            self._isolate(live, exc)
        finally:
            for r in live:
                r.finish()
        return True

    def _isolate(self, batch: list[EngineRequest], exc: Exception) -> None:
        """A batch failed: find whose request it was. Each request that has not been sent a
        token yet runs again on its own, so one bad request fails only itself and its
        batch-mates still get their answers; a request that already streamed tokens cannot
        be replayed and fails with the error."""
        if len(batch) == 1:
            batch[0].error = _as_error(exc, batch[0])
            return
        logger.warning("a batch of %d requests failed (%s); running each alone", len(batch),
                       type(exc).__name__)
        for r in batch:
            if any(o.token_ids for o in r.outputs):
                r.error = _as_error(exc, r)
                continue
            try:
                self.batches += 1
                self.runner.run([r])
            except Exception as solo:
                r.error = _as_error(solo, r)


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


def _as_error(exc: Exception, request: EngineRequest) -> AphroditeError:
    """What the client is told: our own errors as they are; anything else is a bug (500),
    logged here with its traceback (the client sees only its type)."""
    if isinstance(exc, AphroditeError):
        return exc
    logger.error("generation failed for %s", request.request_id, exc_info=exc)
    return InternalError(f"generation failed: {type(exc).__name__}")
