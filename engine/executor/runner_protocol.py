"""What the engine asks of a model runner: the :class:`Runner` protocol.

:class:`~engine.executor.engine.Engine` owns the request lifecycle (queues, the scheduler's
plan each step, joins, retirement, cancellation, a failure kept to its own request) and
calls a runner only for forward passes. ``Engine(loaded, config, runner=...)`` takes any
object with these members: :class:`~engine.executor.runner.TransformersRunner` (the default,
built from ``loaded``) or a fake that makes tokens without a model (tests/fake_runner.py: the
lifecycle tests run in milliseconds). A runner hands each row's sampled token on with
:func:`engine.executor.outputs.add_token`, which decides with
:func:`~engine.executor.stop.check_stop` whether the row ends.

No torch here, and none in what this imports.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

from engine.executor.request import EngineRequest
from engine.executor.row import Row


class Batch(Protocol):
    """Rows stepped together (the runner's cache for them is its own business)."""

    rows: list[Row]

    def join(self, other: Any) -> None:
        """``other``'s rows join these (after them)."""

    def keep(self, rows: list[Row]) -> None:
        """Only ``rows`` stay (their order kept)."""

    def split(self, rows: list[Row]) -> Any:
        """A copy holding only ``rows`` (for running them apart)."""


class Chunked(Protocol):
    """A prompt being prefilled a chunk per step: its row, the prompt tokens in so far (the
    next chunk starts there) and when the first chunk was planned."""

    row: Row
    done: int
    started: float


class PrefillIncomplete(Exception):
    """A prefill's pass failed after earlier passes' rows got their first tokens: those rows
    (``batch``, to join), the rows not prefilled (``rows``: the failed pass's and those after
    it) and the pass's exception (``cause``)."""

    def __init__(self, batch: Any, rows: list[Row], cause: Exception) -> None:
        super().__init__(f"{len(rows)} rows not prefilled: {cause!r}")
        self.batch, self.rows, self.cause = batch, rows, cause


class Runner(Protocol):
    """The forward passes the engine runs, and what it reads of the model."""

    #: called after each prefill pass's first tokens were handed on (the engine sends them)
    on_first_tokens: Callable[[], None] | None
    #: the prompt tokens that receive media features (the scheduler keeps a chunk of a long
    #: prompt from ending inside its media span)
    media_token_ids: Collection[int]
    #: whether a prefill may start inside a prompt's media span
    resumes_in_media: bool
    #: the prefix cache and the encoder output cache (``clear()`` each), or None when off
    prefix_cache: Any
    encoder_cache: Any
    #: the model's parameters (whether prefills overlap decode steps depends on it)
    num_parameters: int

    def set_threads(self, count: int) -> None:
        """Run the calling thread's forward passes on ``count`` threads."""

    def prefetch(self, requests: Iterable[EngineRequest]) -> None:
        """Prepare the next prefills' inputs (positions, media) ahead, off the engine's
        thread (the waiting requests, oldest first)."""

    def grammars(self) -> Any:
        """The compiled structured-output grammars (``compile(spec)`` -> a future)."""

    def cache_stats(self) -> dict[str, float]:
        """The caches' counters for /metrics."""

    def cached_tokens(self, request: EngineRequest) -> int:
        """How many of ``request``'s prompt tokens a prefill now takes from the prefix
        cache."""

    def prefill(self, rows: list[Row]) -> Batch:
        """Prefill ``rows`` and hand on each one's first token; a pass that fails after an
        earlier one handed its rows' tokens on raises :class:`PrefillIncomplete`."""

    def start_chunked(self, row: Row) -> Chunked:
        """Set up the chunked prefill of ``row``'s prompt (from its cached prefix's end)."""

    def prefill_chunk(self, chunked: Any, start: int, end: int) -> Batch | None:
        """Prefill prompt tokens ``[start, end)``; after the last chunk, the row (its first
        token handed on) as a batch of one, else None."""

    def decode(self, batch: Any) -> None:
        """One decode step for every row of ``batch``, each one's token handed on; on an
        exception the batch is as it was before the step."""

    def close(self) -> None:
        """Stop the runner's helper threads."""
