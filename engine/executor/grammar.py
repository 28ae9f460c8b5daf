"""The grammar engine (xgrammar, vLLM's default): constraints compiled for one tokenizer, and
each constrained row's matcher applied to the batch's logits.

:class:`Grammars` compiles a :class:`~engine.executor.structured.GrammarSpec` once: a bounded
LRU of compiled grammars keyed by the constraint (one instance per tokenizer), compiles run
on threads of its own (xgrammar releases the GIL), and a compile asked for while the same
one is under way waits for it. :meth:`Grammars.check` bounds the wait: a compile that ran
past the deadline is a 400 naming the field (it goes on in the background and is cached when
done, so a second identical request does not start another); one that could not even start
because every compile thread is busy is a 503 to retry.

In a step, :func:`mask_logits` fills the bitmask of the rows with a grammar (each row holds
its own ``GrammarMatcher``) and sets every token the grammar forbids to -inf in those rows
only; :func:`accept` advances a row's matcher by the token it sampled. The grammar ends with
the model's end-of-sequence tokens, so a row whose grammar is complete can only sample one
and ends ("stop").

A mask's cost is bounded too: a constraint can compile at once and still make each step's
mask slow, its matcher tracking more ways to have matched as the text grows (a regex of
nested ranged repetitions, ``(.{0,100}){0,100}``: 0.2 s a step on the 449-token tiny model
after 100 tokens, 2 s after 400, every batch-mate waiting). A step whose masks took over
:data:`SLOW_FILL_S` is timed again row by row and each request charged its rows' time
(when over :data:`SLOW_REQUEST_S`); a request charged over :data:`MAX_REQUEST_MASK_S` in all
fails with a 400 naming the field (all its rows end), and the batch goes on.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.errors import InvalidRequestError, OverloadedError, sanitize
from engine.executor.structured import GrammarSpec, schema_objects

#: how long a request waits for its constraint to compile before it is refused
COMPILE_TIMEOUT_S = 10.0
#: compiled grammars kept (each also counts its bytes against CACHE_BYTES)
CACHE_ENTRIES = 256
CACHE_BYTES = 512 << 20
#: compiles that run at once (the others wait their turn)
COMPILE_THREADS = 2
#: compiles waiting for a thread at most: past it a new constraint is a 503 at once (many
#: distinct slow schemas must not queue without bound and starve everyone's constraints)
MAX_QUEUED_COMPILES = 32
#: a step's masks that took longer (s) are timed row by row (a normal step's take well
#: under a millisecond a row, 152k-token vocabularies included)
SLOW_FILL_S = 0.05
#: a request's rows' masks that took longer (s) in a slow step are charged to it (a mask of
#: a 152k-token vocabulary takes about 0.4 ms)
SLOW_REQUEST_S = 0.01
#: mask time (s) one request may be charged in all before it fails
MAX_REQUEST_MASK_S = 2.0

#: xgrammar's messages start with a time and its source file: "[12:00:00] /x/y.cc:12: ..."
_SOURCE = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \([^)]*\) is false:\s*)?")


def logits_vocab(config: dict[str, Any], tokenizer: Any) -> int:
    """The width of the model's logits: its config's vocabulary (often padded past the
    tokenizer's), or the tokenizer's length when the config has none."""
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else len(tokenizer)


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return sanitize(_SOURCE.sub("", text), limit=300)


class _Compile:
    """One compile: its future, and when a thread began it (None: still queued)."""

    def __init__(self) -> None:
        self.future: Future = Future()
        self.started: float | None = None
        self.size = 0
        #: its waiters gave up before a thread took it: it is never compiled
        self.abandoned = False


class Grammars:
    """Compiled grammars for one tokenizer whose model's logits are ``vocab_size`` wide;
    ``stop_ids``: the tokens that end a generation (the grammar's own end)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], *,
                 entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES,
                 threads: int = COMPILE_THREADS) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_ids)))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        #: fills a step's rows' masks in one call
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="aphrodite-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, _Compile] = collections.OrderedDict()
        self.entries, self.max_bytes = entries, max_bytes
        self.stats = {"compiles": 0, "hits": 0}
        self._queued = 0  # compiles submitted that no thread has taken yet

    def compile(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of ``spec`` (a future: done at once from the cache); an
        invalid constraint's future holds its :class:`InvalidRequestError`."""
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
                self.stats["hits"] += 1
                return entry.future
            if self._queued >= MAX_QUEUED_COMPILES:
                raise _busy()
            entry = self._cache[spec.key] = _Compile()
            self.stats["compiles"] += 1
            self._queued += 1
        self._pool.submit(self._run, spec, entry)
        return entry.future

    def _run(self, spec: GrammarSpec, entry: _Compile) -> None:
        with self._lock:
            self._queued -= 1
            entry.started = time.perf_counter()
            if entry.abandoned:  # (already out of the cache: see _late)
                entry.future.set_exception(_busy())
                return
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # the library's word on a bad constraint
            entry.future.set_exception(InvalidRequestError(
                f"{spec.param} does not compile: {_message(exc)}", param=spec.param,
                code="invalid_structured_output", hint="fix the constraint"))
            return
        if not self._first_tokens(compiled):
            entry.future.set_exception(InvalidRequestError(
                f"{spec.param} allows no output at all", param=spec.param,
                code="invalid_structured_output", hint="fix the constraint"))
            return
        entry.size = int(compiled.memory_size_bytes)
        entry.future.set_result(compiled)
        self._evict()

    def _first_tokens(self, compiled: Any) -> bool:
        """Whether a generation under ``compiled`` has a first token (an empty language,
        such as a regex of an empty class, has none: its rows would have nothing to sample)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _compile(self, spec: GrammarSpec) -> Any:
        import json

        compiler = self._compiler
        if spec.kind == "json":
            schema = bounded_strings(json.loads(spec.text))
            return compiler.compile_json_schema(json.dumps(schema),
                                                any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":  # any object (strict mode would allow only {})
            return compiler.compile_json_schema('{"type":"object"}', strict_mode=False,
                                                any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":  # one alternative per choice, each a JSON-escaped literal
            choices = json.loads(spec.text)
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in choices))
        return compiler.compile_grammar(spec.text)

    def _evict(self) -> None:
        """Drop the least recently used finished compiles past the entry and byte bounds."""
        with self._lock:
            done = [(k, e) for k, e in self._cache.items() if e.future.done()]
            total = sum(e.size for _, e in done)
            for key, entry in done:
                if len(self._cache) <= self.entries and total <= self.max_bytes:
                    break
                del self._cache[key]
                total -= entry.size

    def check(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> Any:
        """The compiled grammar, waiting at most ``timeout_s``: an invalid or too slow
        constraint is a 400 naming its field; a compile that never started (every compile
        thread busy) a 503."""
        future = self.compile(spec)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise self._late(spec) from None

    async def check_async(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S
                          ) -> Any:
        """:meth:`check` for an event loop: the loop goes on while the compile runs."""
        import asyncio

        future = asyncio.wrap_future(self.compile(spec))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise self._late(spec) from None

    def _late(self, spec: GrammarSpec) -> Exception:
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None and entry.started is None:
                # never begun: dropped, so the queue does not keep work nobody waits for
                entry.abandoned = True
                del self._cache[spec.key]
                return _busy()
        return InvalidRequestError(
            f"{spec.param} took longer than {COMPILE_TIMEOUT_S:g} s to compile",
            param=spec.param, code="invalid_structured_output",
            hint="simplify the constraint (fewer optional properties, alternatives or "
                 "nested repetitions)")

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _busy() -> OverloadedError:
    return OverloadedError("the grammar compiler is busy with other constraints",
                           code="grammar_compiler_busy",
                           hint="retry after the Retry-After seconds")


def bounded_strings(schema: Any) -> Any:
    """``schema`` with each string's ``minLength``/``maxLength`` (and no pattern or format
    of its own) written as the pattern ``[^\\x00-\\x1f]{min,max}``: xgrammar 0.2.8 lets a
    length-bounded string hold raw control characters, which JSON forbids (``json.loads``
    refuses them); as a pattern it does not (such a string then holds no escapes)."""
    for node in schema_objects(schema):
        bounded = "minLength" in node or "maxLength" in node
        if node.get("type") == "string" and bounded and not {"pattern", "format", "enum",
                                                              "const"} & node.keys():
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = f"[^\\x00-\\x1f]{{{low},{high}}}"
    return schema


def mask_logits(rows: Sequence[Any], logits: Any, grammars: Grammars | None) -> Any:
    """Set the tokens each constrained row's grammar forbids to -inf in ``logits`` (rows,
    vocabulary), in place; a row without a grammar (``row.request.grammar`` None) or done
    is left as it is. A row's matcher is made on its first step. Returns ``logits``."""
    for row in rows:  # a request failed by its grammar's cost: its other rows end too
        if row.request.grammar is not None and row.request.error is not None:
            row.done = True
    constrained = [i for i, r in enumerate(rows)
                   if r.request.grammar is not None and not r.done]
    if not constrained or grammars is None:
        return logits
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), grammars.vocab_size)
    for i in constrained:
        row = rows[i]
        if row.matcher is None:
            row.matcher = grammars.matcher(row.request.grammar)
    live = [i for i in constrained if not rows[i].matcher.is_terminated()]
    if live:  # one call fills them all
        start = time.perf_counter()
        grammars.batch.batch_fill_next_token_bitmask([rows[i].matcher for i in live], bitmask,
                                                     live)
        if time.perf_counter() - start > SLOW_FILL_S:
            live = _charge(rows, live, bitmask)
    alive = bitmask.numpy()[live].any(axis=1) if live else ()  # (one reduction for all)
    for i in (i for i, ok in zip(live, alive, strict=True) if not ok):
        # a dead end the grammar engine let in: the row may only end
        _allow(bitmask, i, rows[i].matcher.stop_token_ids)
    if logits.shape[-1] > grammars.vocab_size:  # columns past the grammar's vocabulary
        logits[constrained, grammars.vocab_size:] = float("-inf")
    if logits.device.type != "cpu":  # xgrammar's Triton kernel where Triton is there
        import importlib.util

        triton = logits.device.type == "cuda" and importlib.util.find_spec("triton")
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=grammars.vocab_size, indices=constrained,
                                        backend="triton" if triton else "torch_native")
        return logits
    # xgrammar's CPU kernel takes contiguous float32 logits
    target = logits if logits.dtype == torch.float32 and logits.is_contiguous() \
        else logits.float().contiguous()
    xgr.apply_token_bitmask_inplace(target, bitmask, vocab_size=grammars.vocab_size,
                                    indices=constrained, backend="cpu")
    if target is not logits:
        logits.copy_(target)
    return logits


def _charge(rows: Sequence[Any], live: list[int], bitmask: Any) -> list[int]:
    """After a slow step: each of ``live`` rows' masks filled again alone, timed; a request
    whose rows took over :data:`SLOW_REQUEST_S` together is charged that time
    (``request.grammar_s``), and fails once charged over :data:`MAX_REQUEST_MASK_S` (all its
    rows end). The rows still live."""
    spent: dict[int, tuple[Any, float]] = {}
    for i in live:
        row = rows[i]
        start = time.perf_counter()
        row.matcher.fill_next_token_bitmask(bitmask, i)
        req, total = spent.get(id(row.request), (row.request, 0.0))
        spent[id(row.request)] = req, total + time.perf_counter() - start
    for req, total in spent.values():
        if total <= SLOW_REQUEST_S:  # (an ordinary mask, even of a large vocabulary)
            continue
        req.grammar_s += total
        if req.grammar_s > MAX_REQUEST_MASK_S and req.error is None:
            param = req.params.structured_outputs.param
            req.error = InvalidRequestError(
                f"{param} took over {MAX_REQUEST_MASK_S:g} s of grammar work while generating "
                "(its matches grow ambiguous as the text grows)", param=param,
                code="invalid_structured_output",
                hint="simplify the constraint (no repetition of a part that itself "
                     "repeats a variable number of times, such as (.{0,9}){0,9})")
    for row in rows:
        if row.request.grammar is not None and row.request.error is not None:
            row.done = True
    return [i for i in live if not rows[i].done]


def _allow(bitmask: Any, row: int, tokens: Iterable[int]) -> None:
    """Let ``row`` sample ``tokens`` (its stop tokens: nothing else is left to it)."""
    for token in tokens:
        word, bit = divmod(int(token), 32)
        value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def accept(row: Any, token: int) -> bool:
    """Advance ``row``'s matcher by ``token``; whether its grammar is now complete (the row
    then ends). A token the grammar refuses cannot have been sampled (the mask forbids it):
    a bug, raised as such."""
    matcher = row.matcher
    if matcher is None:
        return False
    if not matcher.accept_token(token):
        if token in matcher.stop_token_ids:  # (a dead end's way out: see mask_logits)
            return True
        from engine.errors import InternalError

        raise InternalError(f"the grammar refused token {token} it allowed")
    return bool(matcher.is_terminated())
