"""A generation request as the engine sees it, and what comes back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.config import PRIORITY_RANGE
from engine.errors import InvalidRequestError
from engine.executor.sampling import SamplingParams
from engine.processing.preprocess import ProcessedPrompt

_ids = itertools.count()


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability and rank (1 = most likely) in the distribution
    it was sampled from, and the ``k`` most likely tokens' ids and log-probabilities (most
    likely first). Plain numbers: what crosses the engine-process socket (as a tuple)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Logprob:
    """vLLM's per-token entry of ``CompletionOutput.logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sequence's result. ``logprobs`` (when the request asked for them) is vLLM's shape:
    per generated token, a dict from token id to :class:`Logprob` holding the generated
    token and the top ``k``; ``cumulative_logprob`` is the sum of the generated tokens'."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended it; None for EOS, length, abort
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def add_logprobs(self, token: int, lp: TokenLogprobs) -> None:
        entry = {tid: Logprob(v, rank) for rank, (tid, v) in
                 enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1)}
        entry.setdefault(token, Logprob(lp.logprob, lp.rank))
        # the generated token first, as vLLM orders them
        entry = {token: entry.pop(token), **entry}
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.append(entry)
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + lp.logprob


@dataclass
class TokenEvent:
    """One step for one sequence: the new text, and the finish reason when it ended;
    ``logprobs`` of ``token_id`` when the request asked for them."""

    request_id: str
    index: int
    token_id: int | None
    text_delta: str
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    #: with ``finish_reason``: vLLM's ``stop_reason`` (see :class:`CompletionOutput`)
    stop_reason: int | str | None = None


@dataclass
class EngineRequest:
    prompt: ProcessedPrompt
    params: SamplingParams
    on_event: Callable[[TokenEvent], None] | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    outputs: list[CompletionOutput] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    on_done: Callable[[EngineRequest], None] | None = None
    #: prompt tokens whose keys and values came from the prefix cache (vLLM's
    #: ``num_cached_tokens``; ``usage.prompt_tokens_details.cached_tokens``)
    num_cached_tokens: int = 0
    #: vLLM's request ``priority``: with ``--scheduling-policy priority`` lower values join
    #: the running batch first
    priority: int = 0
    #: the client request this one belongs to (the prompts of one completion share it): the
    #: scheduler interleaves groups' rows (fairness per sequence); None: a group of its own
    group: str | None = None
    #: the prompt's inputs prepared off the engine thread (:mod:`engine.executor.prefetch`):
    #: a future while under way
    inputs: Any = None
    #: the compiled grammar of ``params.structured_outputs`` (set before the request queues)
    grammar: Any = None
    #: mask time charged to its rows on slow steps (s; see ``grammar.mask_logits``)
    grammar_s: float = 0.0

    @property
    def fair_group(self) -> str:
        """The group the scheduler shares the batch by (its own id when it has none)."""
        return self.group if self.group is not None else self.request_id

    def finish(self) -> None:
        """Mark done (the engine thread calls this once) and run ``on_done``: a caller that
        must act on completion needs no thread of its own waiting on ``done``."""
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    def cancel(self) -> None:
        """The client went away: stop generating for it at the next step."""
        self.cancelled.set()


def checked_priority(value: object, policy: str) -> int:
    """vLLM's request ``priority``: an integer in :data:`~engine.config.PRIORITY_RANGE`, and
    other than 0 only under ``--scheduling-policy priority`` (vLLM refuses it too: a client
    must not believe it was honoured)."""
    low, high = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"priority must be an integer from {low} to {high}, not "
                                  f"{value!r}", param="priority")
    if value and policy != "priority":
        raise InvalidRequestError(
            f"priority={value} needs priority scheduling; this server schedules {policy}",
            param="priority", code="unsupported_parameter",
            hint="leave priority out, or start the server with --scheduling-policy priority")
    return value
