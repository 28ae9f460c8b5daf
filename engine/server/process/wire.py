"""The messages between an API server and the engine process, one type per kind.

They travel pickled over a ``multiprocessing.connection`` (one connection per API server,
:mod:`engine.server.process.engine_client` on one end, :mod:`engine.server.process.engine_proc` on
the
other). Each is a ``NamedTuple``: fields by name in the code, and on the wire a class
reference (written once per pickle) and a tuple, as cheap as the bare tuples they replace.
Only plain values travel: ids, numbers, strings, numpy arrays or shared-memory references
(:mod:`engine.server.process.shared_inputs`); token strings for logprobs are decoded by the API
server.

API server -> engine: :class:`Submit`, :class:`Cancel`, :class:`StatsQuery`,
:class:`ResetQuery`.
Engine -> API server: :class:`Events` (one engine step's :class:`Delta` s, one message per
step), :class:`Done` (a request's end: its :class:`Output` s, timings, or its
:class:`Failure`), :class:`Stats`, :class:`ResetAnswer`, and :class:`ResetMmCache` to every
API server (see :mod:`engine.server.api.admin_routes`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: A token's logprobs, when the request asked: ``(logprob, rank, top_ids, top_logprobs)``
#: from the model's raw distribution (see :mod:`engine.server.api.logprobs`).
Logprobs = tuple[float, int, list[int], list[float]]


class Submit(NamedTuple):
    """Run a prompt: ``mm`` is :func:`shared_inputs.export`'s message (the engine maps it
    back with ``shared_inputs.attach``), ``sampling`` the keyword arguments of
    :class:`~engine.executor.sampling.SamplingParams`; ``mm_hashes`` and ``mm_positions``
    the prompt's items' content keys and ``(offset, length)`` token ranges, in prompt order
    (``ProcessedPrompt.mm_hashes``, ``mm_positions``), which the prefix cache names the media
    by."""

    rid: str
    input_ids: list[int]
    mm: dict[str, Any]
    sampling: dict[str, Any]
    mm_hashes: tuple[str, ...] | list[str] = ()
    mm_positions: tuple[tuple[int, int], ...] | list[tuple[int, int]] = ()
    #: for an engine that runs its own processor (``--engine vllm``): the chat-templated
    #: prompt text with one placeholder per item (None: ``input_ids`` is the prompt), ``mm``
    #: then holds the decoded items (see :mod:`engine.server.vllm_adapter.vllm_inputs`), and the
    #: request's processor kwargs travel here
    prompt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    #: vLLM's request priority (lower first under ``--scheduling-policy priority``)
    priority: int = 0
    #: vLLM's ``cache_salt`` (see ``ProcessedPrompt.cache_salt``)
    cache_salt: str | None = None
    #: the client request it is one prompt of (``EngineRequest.group``: fairness per sequence)
    group: str | None = None


class Cancel(NamedTuple):
    """Stop a request (its client went away); the engine answers nothing more for it."""

    rid: str


class StatsQuery(NamedTuple):
    """Ask for the engine process's memory and scheduler numbers; answered by :class:`Stats`."""

    rid: str


class Delta(NamedTuple):
    """One step of one sequence (row ``index`` of request ``rid``): the new text, the token
    (None for a step that only ends the row), the finish reason when the row ended and
    vLLM's ``stop_reason`` (the stop string or stop token id that ended it)."""

    rid: str
    index: int
    token_id: int | None
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None
    stop_reason: int | str | None = None


class Events(NamedTuple):
    """The deltas of one engine step, for all of this API server's requests."""

    deltas: list[Delta]


class Output(NamedTuple):
    """One row's result."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


class Failure(NamedTuple):
    """Why a request failed: the OpenAI error body and the HTTP status it answers with."""

    body: dict[str, Any]
    status: int


class Done(NamedTuple):
    """A request's end; sent after its last :class:`Events`. ``error`` is None when it ran;
    ``num_cached_tokens``: its prompt tokens the prefix cache supplied (vLLM's name)."""

    rid: str
    outputs: list[Output]
    timings: dict[str, Any]
    error: Failure | None = None
    num_cached_tokens: int = 0
    #: the prompt as the engine tokenized it, when that is not the API server's
    #: ``input_ids`` (``--engine vllm`` expands the placeholders itself): usage counts these
    prompt_token_ids: list[int] | None = None


class Stats(NamedTuple):
    """The answer to :class:`StatsQuery` (see ``engine_proc.process_stats``)."""

    rid: str
    values: dict[str, float]


class ResetQuery(NamedTuple):
    """Reset a cache: ``what`` is ``mm`` (every API server's processor cache: the engine
    sends :class:`ResetMmCache` down every connection) or ``prefix`` (the engine's prefix
    cache); answered by :class:`ResetAnswer`."""

    rid: str
    what: str


class ResetAnswer(NamedTuple):
    """What a :class:`ResetQuery` did (``reset``, and a ``note`` when nothing was)."""

    rid: str
    values: dict[str, Any]


class ResetMmCache(NamedTuple):
    """To every API server: clear your processor cache."""


ToEngine = Submit | Cancel | StatsQuery | ResetQuery
FromEngine = Events | Done | Stats | ResetAnswer | ResetMmCache
