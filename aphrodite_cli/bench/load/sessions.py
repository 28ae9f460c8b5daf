"""Multi-turn sessions for ``bench serve`` (AIPerf's multi-turn and user-centric modes).

A session (AIPerf's conversation) is a first request as the dataset builds it (its media
and prompt) followed by more user turns. Every turn after the first resends the whole
history, as OpenAI clients do: the first user message with its media, each answer the
server gave (the text received), and the new user text. A session's turns go out strictly in
order: turn k + 1 is sent only once turn k's answer has ended; a turn that fails or is
cancelled ends its session (the next turn would have no answer to carry).

Turns per session are drawn from a normal distribution (``--conversation-turn-mean``,
``--conversation-turn-stddev``), rounded half up, at least 1; the pause between an answer and
the next turn likewise (``--conversation-turn-delay-mean/-stddev``, ms, at least 0); both
seeded by the run's ``--seed``.

Two schedules:

- sessions (AIPerf's request-rate and concurrency modes): session starts follow the phase's
  arrival schedule (``--request-rate``, ``--burstiness``, ramp-up), and ``--max-concurrency``
  bounds the sessions in flight (AIPerf's ``--concurrency`` with ``--conversation-num``).
- users (AIPerf's ``--user-centric-rate R --num-users N``): N users each send a turn every
  ``N / R`` seconds (start to start), so the server sees about R requests/s; user u starts
  ``u / R`` s in; an answer that ends after the next turn was due sends that turn at once and
  the user's clock restarts from then (no catch-up burst). A user works through sessions one
  after another, taking the next unstarted one, until ``--conversation-num`` are done.
  ``--max-concurrency`` then bounds requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from aphrodite_cli.bench.data.datasets import BenchRequest, random_words
from aphrodite_cli.bench.harness.media_host import MediaHost
from aphrodite_cli.bench.load.client import (
    LoadConfig,
    TargetRefused,
    one_request,
    refused_alike,
    rendered,
    request_body,
    schedule,
    server_root,
    user_message,
)
from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.load.wire import cancelled_indices, request_headers


@dataclass(frozen=True)
class SessionConfig:
    """The session flags, checked by ``commands/serve_checks.py`` ``check_session_flags``."""

    conversation_num: int  # --conversation-num: sessions per phase
    turn_mean: float = 1.0  # --conversation-turn-mean
    turn_stddev: float = 0.0  # --conversation-turn-stddev
    delay_mean_ms: float = 0.0  # --conversation-turn-delay-mean
    delay_stddev_ms: float = 0.0  # --conversation-turn-delay-stddev
    num_users: int | None = None  # --num-users (user-centric mode)
    user_centric_rate: float | None = None  # --user-centric-rate: requests/s, all users

    @property
    def turn_gap_s(self) -> float | None:
        """Seconds between one user's turns (start to start), in user-centric mode."""
        if self.num_users is None or not self.user_centric_rate:
            return None
        return self.num_users / self.user_centric_rate

    def describe(self) -> dict[str, Any]:
        """What the result says of the sessions."""
        return {"conversation_num": self.conversation_num, "turn_mean": self.turn_mean,
                "turn_stddev": self.turn_stddev, "turn_delay_mean_ms": self.delay_mean_ms,
                "turn_delay_stddev_ms": self.delay_stddev_ms, "num_users": self.num_users,
                "user_centric_rate": self.user_centric_rate, "turn_gap_s": self.turn_gap_s,
                "schedule": "users" if self.turn_gap_s else "sessions"}


def _normal(n: int, mean: float, stddev: float, seed: int, stream: int) -> np.ndarray:
    """n draws of N(mean, stddev) for ``seed`` (``stream`` keeps each quantity's draws apart,
    so adding delays does not change the turn counts)."""
    if stddev <= 0:
        return np.full(n, float(mean))
    return np.random.default_rng([seed, stream]).normal(mean, stddev, n)


def turn_counts(n: int, mean: float, stddev: float, seed: int) -> list[int]:
    """Turns of each of n sessions: N(mean, stddev) rounded half up, at least 1."""
    return [max(1, math.floor(x + 0.5)) for x in _normal(n, mean, stddev, seed, 1)]


def turn_delays(counts: list[int], mean_ms: float, stddev_ms: float, seed: int
                ) -> list[list[float]]:
    """Per session, the seconds to wait before each turn after the first (>= 0)."""
    draws = iter(_normal(sum(c - 1 for c in counts), mean_ms, stddev_ms, seed, 2).tolist())
    return [[max(0.0, next(draws)) / 1000 for _ in range(c - 1)] for c in counts]


@dataclass
class Session:
    """One conversation: its first request (media, prompt), the later turns' texts and the
    pause before each."""

    index: int
    first: BenchRequest
    follow_ups: list[str] = field(default_factory=list)
    delays_s: list[float] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)


def build_sessions(firsts: list[BenchRequest], conf: SessionConfig, *, seed: int,
                   nonce: int, words: int = 8) -> list[Session]:
    """A session per first request, its turns and delays drawn with ``seed``; each later
    turn's text ``words`` random words that name the session and turn (so no two sessions'
    later turns are the same text)."""
    counts = turn_counts(len(firsts), conf.turn_mean, conf.turn_stddev, seed)
    delays = turn_delays(counts, conf.delay_mean_ms, conf.delay_stddev_ms, seed)
    rng = random.Random(f"{seed}:{nonce}")
    return [Session(i, first, [f"Turn {k} of conversation {nonce}-{i}: "
                               + random_words(rng, words)
                               for k in range(2, count + 1)], wait)
            for i, (first, count, wait) in enumerate(zip(firsts, counts, delays, strict=True))]


@dataclass
class SessionRun:
    """What a phase of sessions sent: one record per turn sent (in the order sent), and for
    each its session and turn (from 1)."""

    records: list[RequestRecord]
    placement: list[tuple[int, int]]
    duration_s: float
    send_rate: float
    started_at: float = 0.0  # perf_counter when the schedule's clock started

    def firsts(self, sessions: list[Session]) -> list[BenchRequest]:
        """Each record's session's first request (its media ride along in every turn)."""
        return [sessions[s].first for s, _ in self.placement]


class _Sender:
    """Sends one session's turns and keeps what was sent, shared by a phase's sessions."""

    def __init__(self, sessions: list[Session], cfg: LoadConfig, host: MediaHost | None,
                 cache: dict, session: aiohttp.ClientSession,
                 on_done: Callable[[], None] | None) -> None:
        self.cfg, self.host, self.cache, self.http = cfg, host, cache, session
        self.url = server_root(cfg.target.base_url) + cfg.target.endpoint
        self.headers = request_headers(cfg.target.api_key, cfg.target.headers)
        self.on_done = on_done
        offsets = np.cumsum([0] + [s.turns for s in sessions]).tolist()
        self.offset = dict(zip((s.index for s in sessions), offsets, strict=False))
        self.cut = cancelled_indices(offsets[-1], cfg.arrivals.cancel_rate, cfg.seed)
        self.records: list[RequestRecord] = []
        self.placement: list[tuple[int, int]] = []
        self.sent: list[float] = []
        self.finished: list[RequestRecord] = []  # in the order their answers ended
        self.refused = asyncio.Event()

    async def turns(self, s: Session, before_turn: Callable[[int], Any],
                    slots: asyncio.Semaphore | None = None) -> None:
        """Send ``s``'s turns in order; ``before_turn(k)`` is awaited before turn k (from 1)
        is sent (its delay or the user's clock); ``slots`` is held while a turn is out."""
        first = s.first
        history = list(first.messages) if first.messages is not None else [
            user_message(first, self.cfg, self.host, self.cache)]
        for k in range(1, s.turns + 1):
            await before_turn(k)
            if self.refused.is_set():
                return
            if k > 1:
                history.append({"role": "user", "content": s.follow_ups[k - 2]})
            start = time.perf_counter()
            body = request_body(self.cfg, first.output_len, messages=history)
            record = RequestRecord(len(self.records), encode_s=time.perf_counter() - start)
            self.records.append(record)
            self.placement.append((s.index, k))
            if slots is not None:
                async with slots:
                    await self._send(body, record, self.offset[s.index] + k - 1)
            else:
                await self._send(body, record, self.offset[s.index] + k - 1)
            if not record.ok:
                return  # a failed or cancelled turn has no answer to carry on with
            history.append({"role": "assistant", "content": "".join(record.text)})

    async def _send(self, body: bytes, record: RequestRecord, position: int) -> None:
        self.sent.append(time.perf_counter())
        await one_request(self.http, self.url, self.headers, body, record, self.cfg,
                          position in self.cut)
        self.finished.append(record)
        if self.cfg.abort_after and len(self.finished) == self.cfg.abort_after and \
                refused_alike(self.finished):
            self.refused.set()
        if self.on_done:
            self.on_done()


async def run_sessions(sessions: list[Session], conf: SessionConfig, cfg: LoadConfig,
                       host: MediaHost | None, cache: dict,
                       on_done: Callable[[], None] | None = None) -> SessionRun:
    """Every session's turns against ``cfg``'s target on ``conf``'s schedule (see the
    module's docstring); raises :class:`TargetRefused` as ``run_phase`` does."""
    cfg = replace(cfg, keep_text=True)  # each answer's text goes into the next turn
    for spec in (spec for s in sessions for spec in s.first.media):
        rendered(spec, cfg, cache)  # before the clock starts: rendering is not the target's
    limit = cfg.arrivals.max_concurrency
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit or 0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as http:
        sender = _Sender(sessions, cfg, host, cache, http, on_done)
        start = time.perf_counter()
        if conf.turn_gap_s:
            work = _users(sender, sessions, conf, start,
                          asyncio.Semaphore(limit) if limit else None)
        else:
            work = _sessions(sender, sessions, cfg, start)
        task = asyncio.ensure_future(asyncio.gather(*work))
        watcher = asyncio.ensure_future(sender.refused.wait())
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if sender.refused.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise TargetRefused(sender.finished[: cfg.abort_after], sender.url)
        await task
    duration = time.perf_counter() - start
    span = max(sender.sent) - min(sender.sent) if len(sender.sent) > 1 else 0.0
    return SessionRun(sender.records, sender.placement, duration,
                      (len(sender.sent) - 1) / span if span > 0 else math.inf, start)


async def _until(due: float) -> None:
    delay = due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _sessions(sender: _Sender, sessions: list[Session], cfg: LoadConfig, start: float
              ) -> list[Any]:
    """Session starts on the phase's arrival schedule; --max-concurrency sessions at once."""
    times = schedule(len(sessions), cfg)
    limit = cfg.arrivals.max_concurrency
    slots = asyncio.Semaphore(limit) if limit else None

    async def one(s: Session, at: float) -> None:
        async def before(k: int) -> None:
            if k > 1:
                await asyncio.sleep(s.delays_s[k - 2])

        await _until(start + at)
        if slots is None:
            await sender.turns(s, before)
            return
        async with slots:
            await sender.turns(s, before)

    return [one(s, at) for s, at in zip(sessions, times, strict=True)]


def _users(sender: _Sender, sessions: list[Session], conf: SessionConfig, start: float,
           slots: asyncio.Semaphore | None) -> list[Any]:
    """AIPerf's user-centric rate: each user a turn every ``turn_gap_s`` (start to start),
    user u first at ``u / rate``; a late answer sends the next turn at once and restarts the
    user's clock from then."""
    gap = conf.turn_gap_s or 0.0
    queue = list(reversed(sessions))  # pop() takes the next unstarted session

    async def user(u: int) -> None:
        due = start + u / (conf.user_centric_rate or math.inf)

        async def before(_k: int) -> None:
            nonlocal due
            due = max(due, time.perf_counter())  # a late answer: at once, clock from now
            await _until(due)
            due += gap

        while queue and not sender.refused.is_set():
            await sender.turns(queue.pop(), before, slots)

    return [user(u) for u in range(conf.num_users or 0)]
