"""Admission per sequence: ``--max-pending-requests`` counts the sequences in flight, a
request's prompts times its ``n`` (as vLLM counts a request of ``n`` samples as ``n`` child
requests), not one per HTTP request.

A request takes one slot when its headers arrive (before its body is read: see
:func:`engine.server.api.app.admitted`); once its body is parsed, its other sequences are
charged here. One request is charged at most half the limit (at least one), so the largest
request never locks every other client out; past the limit it is a 503 with Retry-After
naming the flag, like any request that finds no room."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from engine.errors import OverloadedError


def request_share(limit: int) -> int:
    """The most sequences one request is charged: half of ``--max-pending-requests``."""
    return max(1, limit // 2)


def extra_charge(pending: int, sequences: int, limit: int) -> int:
    """The slots a request of ``sequences`` sequences takes beyond the one it holds, with
    ``pending`` (its own slot included) in flight; raises :class:`OverloadedError` when they
    do not fit under ``limit``."""
    extra = min(sequences, request_share(limit)) - 1
    if extra > 0 and pending + extra > limit:
        raise OverloadedError(
            f"this request holds {sequences} sequences (prompts x n) and this API server "
            f"already has {pending - 1} in flight, past --max-pending-requests {limit}",
            hint="retry after the Retry-After seconds, send fewer prompts or a lower n, or "
                 "raise --max-pending-requests")
    return max(extra, 0)


@contextlib.contextmanager
def sequences_charged(state: Any, sequences: int) -> Iterator[None]:
    """Charge a parsed request's sequences to ``state``'s pending count while it runs."""
    extra = extra_charge(state.pending, sequences, state.config.max_pending_requests)
    state.count(pending=extra)
    try:
        yield
    finally:
        state.count(pending=-extra)
