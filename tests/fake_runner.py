"""A :class:`~engine.executor.runner_protocol.Runner` without a model: the engine's request
lifecycle (scheduling, joins, retirement, cancellation, failures, endings) in milliseconds.

Its tokens are deterministic: row ``index`` of a request whose prompt starts with token
``p`` samples, at its ``k``-th step, letter ``(p + index + k) % 26`` (ids 0-25 decode to
"a"-"z"), unless the request's ``extra["script"]`` lists the row's tokens (a list per row,
or one list for all; past its end the row samples EOS). It hands them on through
:func:`engine.executor.outputs.add_token`, as the transformers runner does, so stop
strings, EOS and ``max_tokens`` take the engine's own path. It groups a prefill's rows into
passes by :func:`engine.executor.scheduler.length_groups` and logs every pass.

    engine = Engine(None, EngineConfig(max_num_seqs=2), runner=FakeRunner())
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.executor.outputs import add_token
from engine.executor.request import EngineRequest
from engine.executor.row import Row
from engine.executor.runner_protocol import PrefillIncomplete
from engine.executor.scheduler import length_groups

#: the fake vocabulary: ids 0-25 are "a"-"z"; then a space, two halves of a word, EOS
LETTERS = [chr(ord("a") + i) for i in range(26)]
SPACE, ST, OP, EOS = 26, 27, 28, 29
VOCAB = [*LETTERS, " ", "ST", "OP", "</s>"]
#: the fake media token: a prompt's span of these is what a chunk may not end inside
MEDIA = 30


class FakeTokenizer:
    """Decodes the fake vocabulary (EOS is special: skipped)."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


class FakeBatch:
    """Running rows, in order (no cache)."""

    def __init__(self, rows: Iterable[Row]) -> None:
        self.rows = list(rows)

    def join(self, other: FakeBatch) -> None:
        self.rows += other.rows

    def keep(self, rows: list[Row]) -> None:
        wanted = {id(r) for r in rows}
        self.rows = [r for r in self.rows if id(r) in wanted]

    def split(self, rows: list[Row]) -> FakeBatch:
        return FakeBatch(rows)


@dataclass(eq=False)
class FakeChunked:
    row: Row
    done: int = 0
    started: float = field(default_factory=time.perf_counter)


class FakeRunner:
    """Makes each row's tokens without a model; ``fails(kind, rows)`` (kind "prefill",
    "chunk" or "decode") raising makes that pass raise. ``log`` holds every pass: (kind,
    the request ids of its rows in order) (a chunk: ("chunk", (id, start, end)))."""

    on_first_tokens: Callable[[], None] | None = None
    media_token_ids = frozenset({MEDIA})
    resumes_in_media = False
    prefix_cache = None
    encoder_cache = None
    num_parameters = 0

    def __init__(self, fails: Callable[[str, list[Row]], None] | None = None,
                 pass_tokens: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.eos_ids = {EOS}
        self.fails = fails
        self.pass_tokens = pass_tokens
        self.log: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    # -- what the engine reads besides the forward passes -----------------------------------

    def set_threads(self, count: int) -> None:
        pass

    def prefetch(self, requests: Iterable[EngineRequest]) -> None:
        pass

    def grammars(self) -> Any:
        raise NotImplementedError("the fake runner has no grammars")

    def cache_stats(self) -> dict[str, float]:
        return {}

    def cached_tokens(self, request: EngineRequest) -> int:
        return 0

    def close(self) -> None:
        pass

    # -- the forward passes -----------------------------------------------------------------

    def prefill(self, rows: list[Row]) -> FakeBatch:
        lengths = [len(r.request.prompt.input_ids) for r in rows]
        passes = [[rows[i] for i in g] for g in length_groups(lengths,
                                                              max_tokens=self.pass_tokens)]
        batch: FakeBatch | None = None
        for n, group in enumerate(passes):
            try:
                self._pass("prefill", group)
            except Exception as exc:
                if batch is None:
                    raise
                raise PrefillIncomplete(batch, [r for later in passes[n:] for r in later],
                                        exc) from exc
            if batch is None:
                batch = FakeBatch(group)
            else:
                batch.join(FakeBatch(group))
            if self.on_first_tokens is not None:
                self.on_first_tokens()
        assert batch is not None
        return batch

    def start_chunked(self, row: Row) -> FakeChunked:
        return FakeChunked(row)

    def prefill_chunk(self, chunked: FakeChunked, start: int, end: int) -> FakeBatch | None:
        row = chunked.row
        self.log.append(("chunk", (row.request.request_id, start, end)))
        if self.fails is not None:
            self.fails("chunk", [row])
        chunked.done = end
        if end < len(row.request.prompt.input_ids):
            return None
        self._hand_on([row])
        return FakeBatch([row])

    def decode(self, batch: FakeBatch) -> None:
        self._pass("decode", batch.rows)

    def _pass(self, kind: str, rows: list[Row]) -> None:
        self.log.append((kind, [r.request.request_id for r in rows]))
        if self.fails is not None:
            self.fails(kind, rows)
        self._hand_on(rows)

    def _hand_on(self, rows: list[Row]) -> None:
        now = time.perf_counter()
        for row in rows:
            token = next_token(row)
            row.last_token = token
            add_token(row, token, now, eos_ids=self.eos_ids, tokenizer=self.tokenizer)

    def passes(self, kind: str) -> list[Any]:
        """The logged passes of ``kind``, in order."""
        return [rows for k, rows in self.log if k == kind]


def next_token(row: Row) -> int:
    """Row ``row``'s next token (see the module's docstring)."""
    step = len(row.token_ids)
    script = row.request.extra.get("script")
    if script is not None:
        mine = script[row.index] if script and isinstance(script[0], list) else script
        return mine[step] if step < len(mine) else EOS
    first = row.request.prompt.input_ids[0]
    return (first + row.index + step) % 26


@contextlib.contextmanager
def held(engine: Any) -> Iterator[None]:
    """Hold ``engine``'s thread at a step boundary until the block ends: what is submitted
    meanwhile enters its waiting queue together (deterministic admission order)."""
    from engine.executor.engine import _Call

    gate = threading.Event()
    call = _Call(gate.wait)
    engine._queue.put(call)
    try:
        yield
    finally:
        gate.set()
        call.done.wait(5)
