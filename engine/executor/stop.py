"""Whether a row ends at its new token: :func:`check_stop`, pure (no model, no torch).

As vLLM's scheduler owns ``check_stop`` (vllm/v1/core/sched/utils.py), this decides from the
row's state and its request's :class:`~engine.executor.sampling.SamplingParams` alone, so a
new sampling parameter that ends a row is one more rule here (read from
``row.request.params``) and a test that builds a row, with no model. Stop strings need the
row's text: they are found where the text is decoded, by
:class:`~engine.executor.detokenize.StopStrings` (vLLM's detokenizer does the same), and
end the row with "stop" as the rules here do.
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from engine.executor.row import Row


class Stop(NamedTuple):
    """A row's end: its ``finish_reason`` (vLLM's: "stop", "length", "abort"), whether
    the token that ended it is part of its output (``keeps_token``: a cancelled row's is not;
    the others are, counted in its usage and its logprobs, as vLLM counts them), whether its
    text stays out of the output (``silent``: an EOS, a stop token, a grammar's last token,
    unless ``include_stop_str_in_output``, as vLLM's detokenizer leaves them out), and vLLM's
    ``stop_reason``: the stop token id that ended it (None for EOS, length, abort, a grammar;
    a stop string is the detokenizer's to name)."""

    reason: str
    keeps_token: bool = True
    stop_reason: int | None = None
    silent: bool = False


def check_stop(row: Row, token: int, *, eos_ids: Container[int],
               grammar_complete: bool = False) -> Stop | None:
    """Why ``row`` ends at ``token``, its newly sampled token not yet in ``row.token_ids``,
    or None when it goes on. In order: its request was cancelled ("abort"); its grammar
    (structured outputs) is complete with this token (``grammar_complete``, found by the
    row's matcher: "stop"); ``token`` is one of ``eos_ids`` and ``ignore_eos`` is off
    ("stop"); the token is the ``max_tokens``-th ("length", kept)."""
    request = row.request
    params = request.params
    if request.cancelled.is_set():
        return Stop("abort", keeps_token=False)
    if grammar_complete:
        return Stop("stop", silent=True)
    # an EOS (unless ignore_eos) or one of stop_token_ids, once min_tokens are out (vLLM's
    # rule: before that such tokens are banned from sampling; a grammar may still force one)
    if len(row.token_ids) >= params.min_tokens:
        if token in eos_ids and not params.ignore_eos:
            return Stop("stop", silent=True)  # (vLLM checks EOS first: no stop_reason)
        if token in params.stop_token_ids:
            return Stop("stop", stop_reason=token, silent=True)
    if len(row.token_ids) + 1 >= params.max_tokens:
        return Stop("length")
    return None
