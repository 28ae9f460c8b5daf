"""The engine process: owns the model and the batching engine; API server processes talk to
it over local connections (one per API server), in the messages of
:mod:`engine.server.process.wire`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from multiprocessing.connection import Connection, Listener
from typing import Any

from engine.config import EngineConfig
from engine.errors import AphroditeError, internal_error_body
from engine.server.process import shared_inputs
from engine.server.process.engine_side import accept_api_servers, read_messages
from engine.server.process.outbox import Outbox
from engine.server.process.wire import (
    Delta,
    Done,
    Events,
    Failure,
    Output,
    ResetAnswer,
    ResetMmCache,
    ResetQuery,
    Stats,
    StatsQuery,
    Submit,
)

logger = logging.getLogger("aphrodite.engine")


def process_stats(live_requests: int, scheduler: dict[str, float] | None = None
                  ) -> dict[str, float]:
    """The engine process's memory as /metrics reports it: RSS, glibc heap in live blocks
    and free-but-kept, objects freed by the cyclic collector, requests in flight here, and
    the scheduler's rows and step counters."""
    import gc

    from engine.memory import heap_stats, rss_bytes

    heap = heap_stats() or {}
    return {"rss_bytes": rss_bytes() or 0, "heap_in_use_bytes": heap.get("live", 0),
            "heap_free_bytes": heap.get("free", 0),
            "gc_objects_collected": sum(g["collected"] for g in gc.get_stats()),
            "requests_in_flight": live_requests, **(scheduler or {})}


def serve_engine(*, address: str, authkey: bytes, model: str | None,
                 chat_template: str | None, config: EngineConfig, ready: Any,
                 api_servers: int, cpus: list[int] | None = None) -> None:
    """Entry point of the engine process (blocks until every API server disconnected);
    ``cpus``: the CPUs it runs on (a data-parallel engine's share), set before torch starts
    its threads (the engine's default thread count and overlap are worked out from them)."""
    from engine.lifetime import exit_sooner, exit_with_parent, name_process

    if cpus:
        _pin(cpus)
    name_process("engine")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # (cleanly: see the finally below)
    exit_with_parent()  # ... or its death does
    from engine.cpus import in_own_thread, use_torch_threads
    from engine.executor.engine import Engine
    from engine.memory import tune_allocator
    from engine.models.loader import load_model

    tune_allocator()
    # loaded on a thread of its own, whose OpenMP workers end with it; this one only serves
    # the connections (one torch thread: it never starts workers of its own)
    engine = in_own_thread(lambda: Engine(load_model(model, chat_template=chat_template),
                                          config))
    use_torch_threads(1)
    listener = Listener(address, authkey=authkey)
    try:
        ready.send((os.getpid(), engine.threads_summary))
        ready.close()
        _serve_connections(listener, engine, api_servers)
    finally:
        # The socket file (and the private folder it sits in) is gone however we stop, also
        # when the supervisor was killed outright and could not remove it.
        listener.close()
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(address))
    engine.close()
    exit_sooner()


def _pin(cpus: list[int]) -> None:
    """Run this process on ``cpus``: every thread it has now (the affinity call covers the
    calling thread only, and importing numpy may have started a BLAS pool already) and,
    through the inheritance of the main thread's, every thread started later."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, OSError):
            os.sched_setaffinity(int(tid), cpus)
    os.sched_setaffinity(0, cpus)


def _exit_on_sigterm(*_: Any) -> None:
    raise SystemExit(0)


def _serve_connections(listener: Listener, engine: Any, api_servers: int) -> None:
    """Accept one connection per API server, then serve each on its own thread until every
    API server has disconnected. The listening socket is closed as soon as all are in."""
    import numpy as np
    import torch

    from engine.executor.request import EngineRequest
    from engine.executor.sampling import SamplingParams
    from engine.processing.preprocess import ProcessedPrompt

    lives: list[dict] = []  # each API server's requests in the engine
    senders: list = []  # each API server's send (a processor cache reset goes to all)

    def handle(conn: Connection) -> None:
        lock = threading.Lock()
        live: dict[str, EngineRequest] = {}
        lives.append(live)

        pending: list[Delta] = []  # this step's token events, sent as one message
        outbox = Outbox(conn)

        def send(message: Done | Stats | ResetAnswer | ResetMmCache) -> None:
            outbox.put(message)

        def flush() -> None:
            """Send the events of the step that just ended in one message: one pickle and
            one write per step instead of one per row (the engine calls this after every
            step, and goes on to the next while the outbox writes it)."""
            with lock:
                if not pending:
                    return
                batch = pending[:]
                pending.clear()
                outbox.put(Events(batch))

        engine.on_step.append(flush)
        senders.append(send)

        def finish(rid: str, req: EngineRequest) -> None:
            flush()  # its last events go before its done
            live.pop(rid, None)
            error = None
            if req.error is not None:
                error = Failure(req.error.to_openai(), req.error.status) if isinstance(
                    req.error, AphroditeError) else Failure(internal_error_body(), 500)
            outputs = [Output(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason)
                       for o in req.outputs]
            send(Done(rid, outputs, req.timings, error, req.num_cached_tokens))

        def submit_one(message: Submit) -> None:
            rid = message.rid
            try:
                mm = shared_inputs.attach(message.mm)
            except (OSError, ValueError) as exc:
                logger.error("request %s: its inputs could not be mapped: %s", rid, exc)
                send(Done(rid, [], {}, Failure({"error": {
                    "message": "the request's inputs were lost on the way to the engine",
                    "type": "internal_error", "param": None, "code": "inputs_lost"}}, 503)))
                return
            tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                       for k, v in mm.items()}
            prompt = ProcessedPrompt(message.input_ids, tensors, [], {}, {},
                                     list(message.mm_hashes),
                                     [tuple(p) for p in message.mm_positions],
                                     cache_salt=message.cache_salt)

            def on_event(event) -> None:
                lp = event.logprobs
                with lock:
                    pending.append(Delta(rid, event.index, event.token_id, event.text_delta,
                                         event.finish_reason,
                                         tuple(lp) if lp is not None else None,
                                         event.stop_reason))

            req = EngineRequest(prompt, SamplingParams(**message.sampling), on_event=on_event,
                                on_done=lambda req: finish(rid, req),
                                priority=message.priority, group=message.group)
            live[rid] = req
            engine.submit(req)

        class Ours:  # engine_side.Handlers
            submit = staticmethod(submit_one)

            @staticmethod
            def cancel(rid: str) -> None:
                req = live.get(rid)
                if req is not None:
                    req.cancel()

            @staticmethod
            def stats(message: StatsQuery) -> None:
                send(Stats(message.rid, process_stats(sum(map(len, lives)),
                                                      engine.scheduler_stats())))

            @staticmethod
            def reset(message: ResetQuery) -> None:
                from engine.server.process.cache_reset import engine_answer

                send(ResetAnswer(message.rid, engine_answer(engine, message.what, senders)))

            @staticmethod
            def leave() -> None:
                with contextlib.suppress(ValueError):
                    engine.on_step.remove(flush)
                with contextlib.suppress(ValueError):  # (cache resets no longer reach it)
                    senders.remove(send)
                for req in list(live.values()):  # the engine thread pops
                    req.cancel()
                outbox.close()

        read_messages(conn, Ours)

    threads = accept_api_servers(listener, api_servers, handle)
    for thread in threads:
        thread.join()
