"""A row's tokens handed to its request: text, logprobs, events and the row's end.

A runner samples a row's next token and calls :func:`add_token`; whether the row ends there
is :func:`~engine.executor.stop.check_stop`'s decision (pure), the text and its stop strings
are the row's :class:`~engine.executor.detokenize.OutputText`'s. :func:`finish_row` ends a
row without a token of its own (cancelled, failed). No torch here: a fake runner (the
lifecycle tests) hands its tokens on through the same code as the transformers runner.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from engine.executor import grammar
from engine.executor.detokenize import OutputText
from engine.executor.request import TokenEvent, TokenLogprobs
from engine.executor.row import Row
from engine.executor.stop import check_stop


def add_token(row: Row, token: int, now: float, lp: TokenLogprobs | None = None, *,
              eos_ids: Container[int], tokenizer: Any,
              byte_ids: frozenset[int] = frozenset()) -> None:
    """Hand ``row``'s new ``token`` (sampled at ``now``; ``lp``: its logprobs when asked) to
    its request, or end the row (:func:`~engine.executor.stop.check_stop`). ``tokenizer``
    and ``byte_ids`` decode the row's text; ``eos_ids`` end it."""
    if row.done:
        return
    req, params = row.request, row.request.params
    out = req.outputs[row.index]
    if params.logprobs is not None and out.logprobs is None:
        out.logprobs = []  # asked for: a list, empty when the first token ends it
    if row.first_token_at is None:
        row.first_token_at = now
    # its grammar (structured outputs) takes the token only while the row goes on
    complete = not req.cancelled.is_set() and grammar.accept(row, token)
    stop = check_stop(row, token, eos_ids=eos_ids, grammar_complete=complete)
    if stop is not None and not stop.keeps_token:
        finish_row(row, stop.reason, stop.stop_reason)
        return
    if row.output is None:  # the tokens go into one list, read when the request ends
        row.output = OutputText(tokenizer, byte_ids, params.stop, row.token_ids,
                                params)
        out.token_ids = row.token_ids
    last = stop is not None
    # appends the token to row.token_ids (a silent one without its text)
    delta, stopped = row.output.add(token, last, silent=last and stop.silent)
    reason = "stop" if stopped else stop.reason if stop is not None else None
    stop_reason = row.output.stop_string if stopped else \
        stop.stop_reason if stop is not None else None
    out.text = row.output.text
    if lp is not None:
        out.add_logprobs(token, lp)
    if req.on_event:
        req.on_event(TokenEvent(req.request_id, row.index, token, delta, reason, lp,
                                stop_reason))
    if reason:
        row.done = True
        out.finish_reason, out.stop_reason = reason, stop_reason


def finish_row(row: Row, reason: str, stop_reason: int | str | None = None) -> None:
    """End ``row`` without a token of its own (cancelled, failed; ``stop_reason``: vLLM's);
    text a stop string could still have taken back goes out with the end."""
    row.done = True
    out = row.request.outputs[row.index]
    if out.finish_reason is None:
        out.finish_reason, out.stop_reason = reason, stop_reason
        held = row.output.flush() if row.output is not None else ""
        if row.request.on_event:
            row.request.on_event(TokenEvent(row.request.request_id, row.index, None, held,
                                            reason, None, stop_reason))
