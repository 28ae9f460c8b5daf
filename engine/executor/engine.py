"""The engine: one thread owns the model and runs a step at a time (continuous batching).

Each step the scheduler (:mod:`engine.executor.scheduler`, no model in it) plans which
waiting rows join and how many prompt tokens each prefills; this class executes the plan:
prefill (together, or a chunk of a long prompt), merge into the running batch, then one
decode step for every running row; finished rows leave between steps. An exception fails
only the request that caused it (see ``_isolate``). The forward passes are a
:class:`~engine.executor.runner_protocol.Runner`'s (the transformers runner unless one is
given), so this lifecycle runs without a model too (tests/fake_runner.py).

With ``EngineConfig.overlap_prefill`` (a CPU with a core to spare), the rows admitted while
others run are prefilled on a second thread while this one keeps stepping the running batch:
the model's products run without the GIL, so an encoder and a prefill on some cores and the
decode steps on another proceed together, where one thread would stop every running row
for the whole prefill. The prefilled rows join at the first step boundary after they are
done; nothing is planned meanwhile (the plan reads the prefix cache the prefill fills).

torch's thread count belongs to the thread that sets it: the engine thread and the prefill
thread each set theirs (``--num-threads``), and the engine thread runs its decode steps on
``--decode-threads``, so a prefill beside a decode step keeps its own count.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from engine.cpus import usable_cpus, use_torch_threads
from engine.errors import AphroditeError, InternalError
from engine.executor.outputs import finish_row
from engine.executor.prefetch import Prefetcher
from engine.executor.request import CompletionOutput, EngineRequest
from engine.executor.row import Row
from engine.executor.runner import TransformersRunner
from engine.executor.runner_protocol import Batch, Chunked, PrefillIncomplete, Runner
from engine.executor.sampler import seeded_generator
from engine.executor.scheduler import (
    Chunk,
    Prefilling,
    Scheduler,
    SeqState,
    StepPlan,
    chunk_limit,
)
from engine.models.loader import LoadedModel

logger = logging.getLogger("aphrodite.engine")


class _Call:
    """A function the engine thread runs between two steps (it comes through the request
    queue, so an idle engine wakes for it); ``done`` is set once it ran."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.result, self.done = fn, None, threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        finally:
            self.done.set()


@dataclass
class _InFlight:
    """A prefill running on the prefill thread: its rows, plan and start, and its result."""

    rows: list[Row]
    step: StepPlan
    started: float
    future: Future


class Engine:
    """Owns a :class:`~engine.executor.runner_protocol.Runner` (a :class:`TransformersRunner`
    unless one is given) and a queue; ``submit`` is thread-safe. Its settings are ``config``
    (read at every step: a benchmark may swap in another scheduling)."""

    def __init__(self, loaded: LoadedModel | None, config: EngineConfig | None = None, *,
                 batch_wait_s: float = 0.005, runner: Runner | None = None) -> None:
        """``runner``: the forward passes (default: a :class:`TransformersRunner` of
        ``loaded``; a fake one runs the lifecycle without a model, ``loaded`` then None)."""
        self.config = config if config is not None else EngineConfig()
        # torch's own default counts the machine's cores, not the ones this process may use
        self._threads = self.config.num_threads or usable_cpus()
        self._decode_threads = self.config.decode_threads or self._threads
        if runner is None:
            from engine.memory import reserve_gpu_memory

            if loaded is None:
                raise ValueError("an Engine needs a loaded model or a runner")
            use_torch_threads(self._threads)  # (before the model loads)
            reserve_gpu_memory(self.config.device, self.config.reserved_gpu_bytes)
            runner = TransformersRunner(loaded, self.config)
        else:
            runner.set_threads(self._threads)
        self.runner: Runner = runner
        self.runner.on_first_tokens = self._step_done
        self.batch_wait_s = batch_wait_s
        self._queue: queue.Queue[EngineRequest | _Call | None] = queue.Queue()
        self.waiting: collections.deque[Row] = collections.deque()
        self.running: Batch | None = None
        self.prefilling: Chunked | None = None
        self._rows_left: dict[str, int] = {}
        #: what the scheduler knows of each request in the engine (its rows share it)
        self._seqs: dict[str, SeqState] = {}
        #: the waiting rows' order under the policy, and the starvation counts behind it
        self.scheduler = Scheduler()
        #: under a policy other than "fcfs": the waiting rows in the order the last plan took
        #: them
        self._order: list[Row] | None = None
        #: prefill forward passes (the isolation test counts them), decode steps, and tokens
        self.batches = 0
        self.stats = {"steps_total": 0, "prefill_tokens_total": 0, "decode_tokens_total": 0,
                      "batch_size_max": 0, "batch_size_last": 0,
                      "prefills_overlapped_total": 0}
        #: called on the engine thread after every step (prefill or decode), e.g. to send the
        #: step's token events to a client in one message
        self.on_step: list[Callable[[], None]] = []
        parameters = self.runner.num_parameters
        cpus = usable_cpus()
        overlap = self.config.overlaps_prefill(cpus, parameters)
        if overlap and self.config.oversubscribes(cpus):
            logger.warning("--overlap-prefill with %d torch threads for prefills beside %d for "
                           "decode steps on %d CPUs: the two take turns on the cores (set "
                           "--num-threads and --decode-threads to at most the CPUs together)",
                           self._threads, self._decode_threads, cpus)
        #: the thread settings in effect, as ``serve`` prints them at start-up
        self.threads_summary = (
            f"torch threads {self._threads} (--num-threads), {self._decode_threads} in decode "
            f"steps (--decode-threads); prefills beside decode steps "
            f"{'on' if overlap else 'off'} (--overlap-prefill; {cpus} CPUs usable, "
            f"{parameters / 1e6:.1f} M parameters)")
        logger.info("%s", self.threads_summary)
        if overlap and self.config.long_prefill_token_threshold is None:
            # a long prompt's prefill runs beside the decode steps whole: chunking it would
            # stop them for each chunk instead
            self.config = replace(self.config, long_prefill_token_threshold=0)
        self._prefiller = ThreadPoolExecutor(
            1, thread_name_prefix="aphrodite-prefill", initializer=self.runner.set_threads,
            initargs=(self._threads,)) if overlap else None
        self._in_flight: _InFlight | None = None
        self._thread = threading.Thread(target=self._loop, name="aphrodite-engine", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest) -> EngineRequest:
        """Queue ``request``; one with a constraint (``params.structured_outputs``) whose
        grammar is not compiled yet queues once it is (compiled off this thread and the
        engine's; a constraint that does not compile fails the request)."""
        spec = request.params.structured_outputs
        if spec is None or request.grammar is not None:
            self._queue.put(request)
            return request

        def compiled(future: Future) -> None:
            try:
                request.grammar = future.result()
            except Exception as exc:
                request.error = _as_error(exc, request)
            self._queue.put(request)

        try:
            future = self.runner.grammars().compile(spec)
        except Exception as exc:  # (its queue of compiles is full: failed as any compile)
            future = Future()
            future.set_exception(exc)
        future.add_done_callback(compiled)
        return request

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Empty the prefix cache (``POST /reset_prefix_cache``), on the engine thread between
        two steps: a step planned on cached blocks never finds them gone. Waits for it."""
        prefix = self.runner.prefix_cache
        if prefix is None:
            return {"reset": False, "has_cache": False,
                    "note": "prefix caching is off (or this model's cache cannot be cut into "
                            "blocks): nothing to reset"}
        return self._between_steps(prefix.clear, timeout_s, "blocks_dropped")

    def reset_encoder_cache(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Empty the encoder output cache (part of ``POST /reset_mm_cache``: the media's
        cached results), on the engine thread between two steps. Waits for it."""
        encoder = self.runner.encoder_cache
        if encoder is None:
            return {"encoder_cache": False}
        return self._between_steps(encoder.clear, timeout_s, "encoder_entries_dropped")

    def _between_steps(self, fn: Callable[[], Any], timeout_s: float, name: str
                       ) -> dict[str, Any]:
        call = _Call(fn)
        self._queue.put(call)  # wakes an idle engine; a busy one takes it before its next step
        if not call.done.wait(timeout_s):
            return {"reset": False, "note": f"the engine did not reach a step boundary in "
                                            f"{timeout_s:g} s"}
        return {"reset": True, name: call.result}

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.runner.close()
        if self._prefiller is not None:
            self._prefiller.shutdown(wait=False)

    def _running_rows(self) -> int:
        running, flying = self.running, self._in_flight  # read once: /metrics asks too
        return (len(running.rows) if running is not None else 0) + (
            len(flying.rows) if flying is not None else 0)

    def scheduler_stats(self) -> dict[str, float]:
        """Rows running and waiting now, and the step counters (for /metrics)."""
        return {"num_rows_running": self._running_rows() + (self.prefilling is not None),
                "num_rows_waiting": len(self.waiting) + self._queue.qsize(), **self.stats,
                **self.runner.cache_stats()}

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        self.runner.set_threads(self._threads)
        while self._pull():
            self._drop_cancelled()
            self.runner.prefetch(row.request for row in self.waiting)
            decode = True
            # a prefill beside the decode steps joins once done; with nothing to decode
            # meanwhile, the engine waits for it
            if self._settle(wait=self.running is None or not self.running.rows):
                self._step_done()
            if self._in_flight is None:
                step = self._plan()
                self._prefill_step(step)
                self._step_done()  # first tokens go out before the next decode step
                decode = step.decode_rows
            if decode and self.running is not None and self.running.rows:
                self._decode(self.running)
                self._step_done()
        self._settle(wait=True)

    def _plan(self) -> StepPlan:
        chunked = self.prefilling
        progress = None if chunked is None else Prefilling(
            self._seqs[chunked.row.request.request_id], chunked.done)
        step, self._order = self.scheduler.schedule(
            self.waiting, self._running_rows(), self.config, self._seqs, self._waiting_seq,
            progress, self._running_groups())
        return step

    def _running_groups(self) -> dict[str, int]:
        """Rows running (or being prefilled) per group (a client request's sequences)."""
        counts: collections.Counter[str] = collections.Counter()
        running, flying, chunked = self.running, self._in_flight, self.prefilling
        for rows in (running.rows if running is not None else (),
                     flying.rows if flying is not None else (),
                     (chunked.row,) if chunked is not None else ()):
            counts.update(r.request.fair_group for r in rows if not r.done)
        return counts

    def _take(self, count: int) -> list[Row]:
        """The first ``count`` waiting rows in the order the plan took them, out of the
        queue (which keeps the rest in age order)."""
        if self._order is None:
            return [self.waiting.popleft() for _ in range(count)]
        chosen = self._order[:count]
        ids = {id(r) for r in chosen}
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in ids)
        self._order = None
        return chosen

    def _waiting_seq(self, row: Row) -> SeqState:
        """A waiting row as the scheduler sees it now: with the prompt tokens the prefix
        cache holds at this step (the prefill that follows takes exactly those), so only the
        uncached ones are charged to the token budget. Read lazily: only the rows the plan
        looks at are looked up."""
        seq = self._seqs[row.request.request_id]
        cached = self.runner.cached_tokens(row.request)
        return seq if cached == seq.cached_tokens else replace(seq, cached_tokens=cached)

    def _step_done(self) -> None:
        for callback in list(self.on_step):
            callback()

    def _pull(self) -> bool:
        """Move submitted requests into the waiting queue, as rows. An idle engine blocks for
        the first and then waits ``batch_wait_s`` for others sent at the same moment (so they
        share one prefill); a busy one takes what is there and goes on stepping."""
        idle = not self.waiting and self.prefilling is None and self._in_flight is None and (
            self.running is None or not self.running.rows)
        try:
            first = self._queue.get() if idle else self._queue.get_nowait()
        except queue.Empty:
            return True
        if first is None:
            return False
        self._enqueue(first)
        deadline = time.perf_counter() + (self.batch_wait_s if idle else 0.0)
        while True:
            try:
                nxt = self._queue.get(timeout=max(deadline - time.perf_counter(), 0)) \
                    if idle else self._queue.get_nowait()
            except queue.Empty:
                return True
            if nxt is None:
                return False
            self._enqueue(nxt)

    def _enqueue(self, req: EngineRequest | _Call) -> None:
        if isinstance(req, _Call):  # a function for between two steps (reset_prefix_cache)
            if self._settle(wait=True):  # (no prefill may be using the caches meanwhile)
                self._step_done()
            req.run()
            return
        if req.error is not None:  # its constraint did not compile: it never ran
            req.finish()
            return
        req.outputs = [CompletionOutput(i) for i in range(req.params.n)]
        self._rows_left[req.request_id] = req.params.n
        self._seqs[req.request_id] = self._seq_state(req)
        for i in range(req.params.n):
            gen = None
            if req.params.seed is not None:
                gen = seeded_generator(req.params.seed + i)
            self.waiting.append(Row(req, i, gen))

    def _drop_cancelled(self) -> None:
        """Rows whose client went away leave now: waiting, being prefilled or running."""
        chunked = self.prefilling
        if chunked is not None and chunked.row.request.cancelled.is_set():
            self.prefilling = None
            finish_row(chunked.row, "abort")
            self._row_ended(chunked.row)
        for row in [r for r in self.waiting if r.request.cancelled.is_set()]:
            self.waiting.remove(row)
            finish_row(row, "abort")
            self._row_ended(row)
        if self.running is not None:
            for row in self.running.rows:
                if row.request.cancelled.is_set() and not row.done:
                    finish_row(row, "abort")
            self._retire()

    def _seq_state(self, req: EngineRequest) -> SeqState:
        """The scheduler's view of a request's rows. Only a prompt over the smallest chunk
        limit (the token budget, or the long-prefill threshold) can be chunked: only its
        media span is looked up."""
        ids = req.prompt.input_ids
        span = None
        if len(ids) > chunk_limit(self.config, running=1):
            media = self.runner.media_token_ids
            at = [i for i, t in enumerate(ids) if t in media]
            span = (at[0], at[-1]) if at else None
        return SeqState(len(ids), media_span=span,
                        media_resumable=self.runner.resumes_in_media, priority=req.priority)

    def _prefill_step(self, step: StepPlan) -> None:
        """Execute the plan's prefill: the admitted rows together, or a chunk."""
        if step.chunk is not None:
            if step.starts_chunk:
                row = self._take(1)[0]
                try:
                    self.prefilling = self.runner.start_chunked(row)
                except Exception as exc:
                    self._fail([row], exc)
                    return
            if self.prefilling is not None:
                self._prefill_chunk(self.prefilling, step.chunk)
            return
        if not step.admit:
            return
        chosen = self._take(len(step.admit))
        started = time.perf_counter()
        if self._prefiller is not None and self.running is not None and self.running.rows:
            self.batches += 1
            self.stats["prefills_overlapped_total"] += 1
            self._in_flight = _InFlight(chosen, step, started,
                                        self._prefiller.submit(self.runner.prefill, chosen))
            return
        self._admitted(step, chosen, self._prefill(chosen), started)

    def _settle(self, wait: bool) -> bool:
        """The prefill running beside the decode steps, once done (``wait``: once it is
        done), handled as a prefill of this thread's is: its rows join, or on an exception
        each request's rows are prefilled alone. Whether one was handled."""
        flying = self._in_flight
        if flying is None or (not wait and not flying.future.done()):
            return False
        self._in_flight = None
        self._admitted(flying.step, flying.rows, self._prefill(flying.rows, flying.future),
                       flying.started)
        return True

    def _admitted(self, step: StepPlan, chosen: list[Row], joined: Batch | None,
                  started: float) -> None:
        if joined is not None:
            # the uncached prompt tokens of the rows that joined (a failed request's none)
            self.stats["prefill_tokens_total"] += sum(
                size for size, row in zip(step.admit, chosen, strict=True)
                if row in joined.rows)
            self._joined(joined, started)

    def _prefill_chunk(self, chunked: Chunked, chunk: Chunk) -> None:
        try:
            if chunk.start != chunked.done:  # the plan and the prefix cache disagree
                raise InternalError(f"chunk {chunk.start}:{chunk.end} planned after "
                                    f"{chunked.done} prompt tokens in")
            self.batches += 1
            joined = self.runner.prefill_chunk(chunked, chunk.start, chunk.end)
        except Exception as exc:
            self.prefilling = None
            self._fail([chunked.row], exc)
            return
        self.stats["prefill_tokens_total"] += chunk.tokens
        if joined is not None:
            self.prefilling = None
            self._joined(joined, chunked.started)

    def _joined(self, joined: Batch, started: float) -> None:
        """Prefilled rows join the running batch (their stage timings recorded: each row's
        prefill ends with its first token, so TTFT = queue + encoder + prefill)."""
        size = self._running_rows() + len(joined.rows)
        now = time.perf_counter()
        for row in joined.rows:
            req = row.request
            finished = row.first_token_at or now
            req.timings.setdefault("queue_s", round(started - req.submitted, 6))
            req.timings.setdefault("encoder_s", round(row.encoder_s, 6))
            req.timings.setdefault("prefill_s", round(max(
                finished - started - row.encoder_s, 0), 6))
            req.timings.setdefault("batch_size", size)
        if self.running is None or not self.running.rows:
            self.running = joined
        else:
            self.running.join(joined)
        self._retire()

    def _prefill(self, rows: list[Row], done: Future | None = None) -> Batch | None:
        """Prefill ``rows`` together (``done``: that prefill, run on the prefill thread); if
        that raises, each request's rows not yet handed on alone, so the request that broke
        it fails and the others join (with the rows of the passes before the failure)."""
        handed: Batch | None = None
        try:
            if done is not None:
                return done.result()
            self.batches += 1
            return self.runner.prefill(rows)
        except PrefillIncomplete as part:  # earlier passes' rows have their first tokens
            handed, rows, exc = part.batch, part.rows, part.cause
        except Exception as error:
            exc = error
        groups = _by_request(rows)
        if len(groups) == 1 and handed is None:
            self._fail(rows, exc)
            return None
        logger.warning("a prefill of %d requests failed (%s); prefilling each alone",
                       len(groups), type(exc).__name__)

        def alone(group: list[Row]) -> Batch:
            self.batches += 1
            return self.runner.prefill(group)

        joined = self._each_alone(groups, alone)
        if handed is None:
            return joined
        for row in handed.rows:  # a failed request's rows handed on end with it
            if row.request.error is not None:
                row.done = True
        if joined is not None:
            handed.join(joined)
        return handed

    def _decode(self, batch: Batch) -> None:
        self.stats["steps_total"] += 1
        self.stats["batch_size_last"] = len(batch.rows)
        self.stats["batch_size_max"] = max(self.stats["batch_size_max"], len(batch.rows))
        self.stats["decode_tokens_total"] += len(batch.rows)
        with self._decode_step_threads():
            try:
                self.runner.decode(batch)
            except Exception as exc:
                self._isolate(batch, exc)
        self._retire()

    @contextlib.contextmanager
    def _decode_step_threads(self) -> Iterator[None]:
        """A decode step runs on ``--decode-threads`` torch threads; the prefills and
        encoders between the steps on ``--num-threads`` (set on this thread only: a prefill
        on the prefill thread keeps its own count meanwhile)."""
        if self._decode_threads == self._threads:
            yield
            return
        self.runner.set_threads(self._decode_threads)
        try:
            yield
        finally:
            self.runner.set_threads(self._threads)

    def _isolate(self, batch: Batch, exc: Exception) -> None:
        """A decode step failed (the cache is as before it): each request's rows take the step
        alone; those that fail again fail, the others go on in the batch."""
        groups = _by_request(batch.rows)
        if len(groups) == 1:
            self.running = None
            self._fail(batch.rows, exc)
            return
        logger.warning("a decode step of %d requests failed (%s); stepping each alone",
                       len(groups), type(exc).__name__)
        def alone(group: list[Row]) -> Batch:
            part = batch.split(group)
            self.runner.decode(part)
            return part

        self.running = self._each_alone(groups, alone)

    def _each_alone(self, groups: list[list[Row]],
                    run: Callable[[list[Row]], Batch]) -> Batch | None:
        """Run each request's rows on their own: a request whose run raises fails, the
        others' parts are joined into one batch."""
        joined: Batch | None = None
        for group in groups:
            try:
                part = run(group)
            except Exception as exc:
                self._fail(group, exc)
                continue
            if joined is None:
                joined = part
            else:
                joined.join(part)
        return joined

    def _fail(self, rows: list[Row], exc: Exception) -> None:
        """The request of ``rows`` failed: it gets the error (no finish event) and all its
        rows end: those still waiting or being prefilled at once, those running at the next
        retirement (no more steps for them). ``rows`` are no longer in the batch."""
        req = rows[0].request
        req.error = _as_error(exc, req)
        ended = [r for r in self.waiting if r.request is req]
        for row in ended:
            self.waiting.remove(row)
        chunked = self.prefilling
        if chunked is not None and chunked.row.request is req and chunked.row not in rows:
            self.prefilling = None
            ended.append(chunked.row)
        for row in [*rows, *ended]:
            row.done = True
            self._row_ended(row)
        if self.running is not None:
            for row in self.running.rows:
                if row.request is req:
                    row.done = True  # retired (and counted) by _retire before the next step
        flying = self._in_flight
        if flying is not None:  # being prefilled beside the decode steps: retired on joining
            for row in flying.rows:
                if row.request is req and row not in rows:
                    row.done = True

    def _retire(self) -> None:
        """Finished rows leave the batch; a request whose rows all ended is done."""
        batch = self.running
        if batch is None:
            return
        ended = [r for r in batch.rows if r.done]
        if not ended:
            return
        batch.keep([r for r in batch.rows if not r.done])
        for row in ended:
            self._row_ended(row)
        if not batch.rows:
            self.running = None

    def _row_ended(self, row: Row) -> None:
        req = row.request
        if row.first_token_at is not None:
            first = req.timings.get("_first_token_at")
            req.timings["_first_token_at"] = min(first or row.first_token_at,
                                                 row.first_token_at)
        left = self._rows_left.get(req.request_id, 0) - 1
        if left > 0:
            self._rows_left[req.request_id] = left
            return
        self._rows_left.pop(req.request_id, None)
        self._seqs.pop(req.request_id, None)
        self.scheduler.forget(req.request_id)
        Prefetcher.release(req)  # (a request aborted or failed before its prefill read them)
        first = req.timings.pop("_first_token_at", None)
        if req.error is None:
            now = time.perf_counter()
            first = first or now
            req.timings["first_token_s"] = round(first - req.submitted, 6)
            req.timings["decode_s"] = round(now - first, 6)
        req.finish()


def _by_request(rows: list[Row]) -> list[list[Row]]:
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.request.request_id, []).append(row)
    return list(groups.values())


def _as_error(exc: Exception, request: EngineRequest) -> AphroditeError:
    """What the client is told: our own errors as they are; anything else is a bug (500),
    logged here with its traceback (the client sees only its type)."""
    if isinstance(exc, AphroditeError):
        return exc
    logger.error("generation failed for %s", request.request_id, exc_info=exc)
    return InternalError(f"generation failed: {type(exc).__name__}")
