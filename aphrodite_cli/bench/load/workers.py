"""``bench serve --num-workers N``: one phase's requests sent by N client processes that share one
schedule, so one machine can drive a server (or a cluster) faster than one event loop can.

The parent computes everything as one process would (request bodies, arrival times, which
requests are cancelled) and hands each worker every N-th request. The clock is shared:
``time.perf_counter`` is the system-wide monotonic clock on Linux, so the parent fixes one
start time and every send time is measured on the same clock in every process.

- Without ``--max-concurrency`` each worker sends its requests at their absolute times (start
  + arrival) itself: no message per request goes through the parent before a send.
- With ``--max-concurrency`` the parent owns the limit: it walks the schedule in arrival
  order, waits for a free slot (one asyncio semaphore, first come first served, as one
  process's) and hands the request (its body with it) to the worker with the most free
  slots; the worker reports each request's end, which frees its slot. At most
  ``--max-concurrency`` requests are in flight across all workers, granted in the order one
  process would grant them. The slots start split evenly and a slot goes back to the worker
  that freed it, so a worker that gets less CPU (a busy core) is given fewer requests and
  the phase is not held to the slowest worker's pace (with requests dealt out in turn, a
  worker a tenth slower held every slot and the other waited).

Each worker reports every finished request (the parent's progress and its check for a
target that refuses everything, ``--abort-after-failures``, see them in the order they end)
and, at the end, its requests' records; the parent puts them back in request order, so the
metrics are computed from the same records as with one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import aiohttp

from aphrodite_cli.bench.load.metrics import RequestRecord
from engine.errors import BenchmarkFailed

#: Seconds a worker may take to start (import, connect its session) and say it is ready.
READY_TIMEOUT_S = 120.0
#: Seconds between the last worker's "ready" and the shared start: every worker has its
#: start message before the first send time.
START_LEAD_S = 0.05


class _Outbox:
    """Messages of one kind to a connection, sent together once per event-loop turn: at a
    high request rate one pipe write carries many requests' messages."""

    def __init__(self, conn: Connection, kind: str) -> None:
        self.conn, self.kind, self.items, self.armed = conn, kind, [], False

    def put(self, item: Any) -> None:
        self.items.append(item)
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.armed = False
        if self.items:
            items, self.items = self.items, []
            with contextlib.suppress(OSError, ValueError):  # the other end is gone
                self.conn.send((self.kind, items))


class _Inbox:
    """A connection's messages as an asyncio queue (read when the pipe is readable)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.queue = conn, asyncio.Queue()
        asyncio.get_running_loop().add_reader(conn.fileno(), self._read)

    def _read(self) -> None:
        try:
            while self.conn.poll():
                self.queue.put_nowait(self.conn.recv())
        except (EOFError, OSError):  # the other end is gone
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.queue.put_nowait(("gone",))

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.conn.fileno())


def worker_main(conn: Connection, cfg: Any, url: str, headers: dict[str, str],
                items: dict[int, tuple[bytes, float, float, bool]], self_timed: bool) -> None:
    """A worker process: ``items`` maps a request's index to (body, encode seconds, arrival
    seconds after the start, cancel it) when it times its own sends; else each "go" message
    brings the requests to send now, as (index, body, encode seconds, cancel it)."""
    asyncio.run(_worker(conn, cfg, url, headers, items, self_timed))


async def _worker(conn: Connection, cfg: Any, url: str, headers: dict[str, str],
                  items: dict[int, tuple[bytes, float, float, bool]], self_timed: bool) -> None:
    from aphrodite_cli.bench.load.client import one_request

    inbox, done = _Inbox(conn), _Outbox(conn, "done")
    records = {i: RequestRecord(i, encode_s=enc) for i, (_, enc, _, _) in items.items()}
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.arrivals.max_concurrency or 0,
                                           limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as session:

        async def send(i: int, body: bytes, cut: bool) -> None:
            await one_request(session, url, headers, body, records[i], cfg, cut)
            done.put((i, records[i].status))

        async def own_schedule(start: float) -> None:
            for i in sorted(items, key=lambda k: items[k][2]):
                delay = start + items[i][2] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(i, items[i][0], items[i][3])))

        conn.send(("ready",))
        schedule = None
        while True:
            msg = await inbox.queue.get()
            if msg[0] == "start" and self_timed:
                schedule = asyncio.create_task(own_schedule(msg[1]))
            elif msg[0] == "go":
                for i, body, enc, cut in msg[1]:
                    records[i] = RequestRecord(i, encode_s=enc)
                    tasks.append(asyncio.create_task(send(i, body, cut)))
            elif msg[0] in ("end", "stop", "gone"):
                break
        if msg[0] != "end":  # the parent stops the phase: nothing more is sent
            for task in [schedule, *tasks]:
                if task is not None:
                    task.cancel()
        await asyncio.gather(*[t for t in [schedule, *tasks] if t is not None],
                             return_exceptions=True)
    done.flush()
    inbox.close()
    if msg[0] != "gone":
        conn.send(("records", [records[i] for i in sorted(records)]))
    conn.close()


async def run_phase_workers(payloads: list[tuple[bytes, float]], cfg: Any, url: str,
                            headers: dict[str, str], times: list[float], cut: set[int],
                            on_done: Callable[[], None] | None = None
                            ) -> tuple[list[RequestRecord], float, float, list[int]]:
    """The phase by ``cfg.arrivals.num_workers`` processes: the records in request order, the
    duration, the achieved send rate and the indices in the order they finished (the first
    ``abort_after`` of them are what :func:`refused_alike` judges)."""
    from aphrodite_cli.bench.load.client import TargetRefused, refused_alike

    n = cfg.arrivals.num_workers
    dispatch = bool(cfg.arrivals.max_concurrency)  # the parent owns the limit
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no loop, no threads
    conns, procs = [], []
    for w in range(n):  # with the parent dispatching, each request goes with its "go"
        items = {} if dispatch else {i: (payloads[i][0], payloads[i][1], times[i], i in cut)
                                     for i in range(w, len(payloads), n)}
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(theirs, cfg, url, headers, items,
                                                     not dispatch),
                           name=f"bench-client-{w}", daemon=True)
        proc.start()
        theirs.close()
        conns.append(mine)
        procs.append(proc)
    inboxes = [_Inbox(c) for c in conns]
    try:
        for w, inbox in enumerate(inboxes):
            try:
                msg = await asyncio.wait_for(inbox.queue.get(), READY_TIMEOUT_S)
            except TimeoutError:
                msg = ("timeout",)
            if msg[0] != "ready":
                raise BenchmarkFailed(f"client worker {w} of --num-workers {n} did not start "
                                      f"({msg[0]}, exit code {procs[w].exitcode})",
                                      hint="run with --num-workers 1 to see its error")
        return await _drive(payloads, cfg, url, times, cut, inboxes, conns, dispatch, on_done,
                            TargetRefused, refused_alike)
    finally:
        for inbox in inboxes:
            inbox.close()
        for conn in conns:  # a worker still waiting (the parent failed): it stops
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()


async def _drive(payloads: list, cfg: Any, url: str, times: list[float], cut: set[int],
                 inboxes: list[_Inbox], conns: list[Connection], dispatch: bool,
                 on_done: Callable[[], None] | None,
                 target_refused: type, refused_alike: Callable[[list], bool]
                 ) -> tuple[list[RequestRecord], float, float, list[int]]:
    n, total = len(conns), len(payloads)
    limit = cfg.arrivals.max_concurrency
    slots = asyncio.Semaphore(limit) if dispatch else None
    # each worker's free slots (their sum is the semaphore's count): a slot freed by a
    # worker goes back to it, and a request goes to the worker with the most
    free = [limit // n + (w < limit % n) for w in range(n)] if dispatch else []
    finished: list[int] = []
    statuses: dict[int, int | None] = {}
    all_done, refused = asyncio.Event(), asyncio.Event()
    lost: list[int] = []
    if not total:
        all_done.set()

    async def listen(w: int) -> list[RequestRecord]:
        while True:
            msg = await inboxes[w].queue.get()
            if msg[0] == "done":
                for i, status in msg[1]:
                    finished.append(i)
                    statuses[i] = status
                    if slots:
                        free[w] += 1
                        slots.release()
                    if on_done:
                        on_done()
                    if cfg.abort_after and len(finished) == cfg.abort_after and \
                            refused_alike([RequestRecord(k, status=statuses[k])
                                           for k in finished]):
                        refused.set()
                if len(finished) == total:
                    all_done.set()
            elif msg[0] == "records":
                return msg[1]
            elif msg[0] == "gone":
                lost.append(w)
                all_done.set()
                return []

    listeners = [asyncio.create_task(listen(w)) for w in range(n)]
    start = time.perf_counter() + START_LEAD_S
    for conn in conns:
        conn.send(("start", start))
    if dispatch:
        gos = [_Outbox(conn, "go") for conn in conns]
        for i, at in enumerate(times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                for out in gos:  # nothing waits in a batch while the parent sleeps
                    out.flush()
                await asyncio.sleep(delay)
            await slots.acquire()
            if refused.is_set() or lost:
                break
            w = max(range(n), key=free.__getitem__)
            free[w] -= 1
            gos[w].put((i, payloads[i][0], payloads[i][1], i in cut))
        for out in gos:
            out.flush()
    waiter = asyncio.ensure_future(all_done.wait())
    stopper = asyncio.ensure_future(refused.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    stopper.cancel()
    duration = time.perf_counter() - start
    word = "end" if all_done.is_set() and not refused.is_set() else "stop"
    for w, conn in enumerate(conns):
        if w not in lost:
            conn.send((word,))
    parts = await asyncio.gather(*listeners)
    if lost:
        raise BenchmarkFailed(f"client worker(s) {', '.join(map(str, lost))} of --num-workers "
                              f"{n} exited during the phase",
                              hint="run with --num-workers 1 to see the error")
    got = {r.index: r for part in parts for r in part}
    # requests never handed out (the phase was stopped) are recorded unsent, as one process's
    records = [got.get(i) or RequestRecord(i, encode_s=payloads[i][1]) for i in range(total)]
    if refused.is_set():
        raise target_refused([records[i] for i in finished[: cfg.abort_after]], url)
    sent = sorted(r.sent_at for r in records if r.sent_at)
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    send_rate = (len(sent) - 1) / span if span > 0 else float("inf")
    return records, duration, send_rate, finished


async def run_phase(payloads: list[tuple[bytes, float]], cfg: Any,
                    on_done: Callable[[], None] | None = None, session: Any = None,
                    times: list[float] | None = None
                    ) -> tuple[list[RequestRecord], float, float]:
    """``client.run_phase``, by ``cfg.arrivals.num_workers`` processes when there are more than one
    (the one way the benchmarks send a phase; client never imports this module)."""
    from aphrodite_cli.bench.load import client

    if cfg.arrivals.num_workers <= 1 or session is not None:
        return await client.run_phase(payloads, cfg, on_done, session, times)
    url = client.server_root(cfg.target.base_url) + cfg.target.endpoint
    headers = client.request_headers(cfg.target.api_key, cfg.target.headers)
    cut = client.cancelled_indices(len(payloads), cfg.arrivals.cancel_rate, cfg.seed)
    if times is None:  # else a replayed trace's own (load/trace.py)
        times = client.schedule(len(payloads), cfg)
    records, duration, send_rate, _ = await run_phase_workers(
        payloads, cfg, url, headers, times, set(cut), on_done)
    return records, duration, send_rate
