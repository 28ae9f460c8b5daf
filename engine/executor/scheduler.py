"""The scheduler: what the engine does in one step, decided from plain numbers.

No model, no threads, no torch (as vLLM's v1 scheduler: ``schedule()`` returns a plan and the
model runner executes it); :class:`~engine.executor.engine.Engine` asks its
:class:`Scheduler` once per step (:func:`plan` over the waiting rows in the policy's order)
and executes the :class:`StepPlan`; the runner groups a prefill's rows into forward passes by
:func:`length_groups`. Whether a row ends at a token is :func:`engine.executor.stop.check_stop`.
The rules, in the order they apply:

1. A prompt being prefilled in chunks continues: its next chunk is the step's prefill, and
   nothing else joins until its last chunk is in.
2. ``scheduling="static"``: nothing joins a running batch; waiting rows wait for it to end.
3. The waiting rows join in the order of ``scheduling_policy`` (:func:`serving_order`;
   "fcfs": first come, first served) while the batch holds fewer than ``max_num_seqs`` rows
   (a request's ``n`` samples are ``n`` rows, each prefilling its prompt). Fairness per
   sequence: the rows of one client request (every prompt of a completion times its ``n``:
   a *group*) are interleaved with other groups' (:func:`group_loads`: a row whose group
   has fewer rows running or ahead of it goes first), so a small request is not stuck
   behind all the rows of a big one; and under every policy a row passed over
   :data:`~engine.config.MAX_OVERTAKES` times goes before the rest (aging: the bound on
   waiting, under "priority" too).
4. Token budget: the rows that join in one step are prefilled together, in one forward pass
   of at most ``max_num_batched_tokens`` prompt tokens; the first that does not fit waits for
   the next step. A prompt over the budget on its own is prefilled alone, a chunk per step,
   while the running rows go on decoding between its chunks (rule 1).
5. Long prefills (``long_prefill_token_threshold``, vLLM's name): while rows are running, a
   prompt with more tokens to prefill than the threshold is prefilled as one over the budget
   is (alone, a chunk per step, the running rows decoding between its chunks), in chunks of
   at most the threshold, so no running row waits for a whole long prefill; with nothing
   running the budget alone applies (nobody waits). 0: off (:func:`chunk_limit`).
6. A chunk holds at most the step's chunk limit (the budget, or rule 5's threshold while rows
   run), except the one that holds the prompt's media span (its first to last media token),
   which is as long as it must be: the encoder's output lands in one forward pass.
7. Prefix cache: the tokens a row's prompt already has in the cache (``cached_tokens``) are
   not prefilled and not charged to the budget; its last prompt token always is (its logits
   give the first token), and a cached prefix never ends inside the media span (it is cut
   back to the span's start) unless the model resumes there (``media_resumable``: the
   runner feeds it the merged embeddings). Until the cache exists the engine passes 0.
8. Every running row, those that joined this step included, then takes one decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.config import MAX_OVERTAKES, EngineConfig, SchedulingPolicy
from engine.executor.row import Row


@dataclass(frozen=True)
class SeqState:
    """What the scheduler knows of a waiting row: its prompt's length in tokens, how many of
    them the prefix cache holds, and where its media tokens are (``[first, last]``, or None
    for a prompt without media; only looked up for a prompt that may be chunked), whether
    a prefill may start inside that span (rule 7), and its request's ``priority`` (rule 3)."""

    prompt_tokens: int
    cached_tokens: int = 0
    media_span: tuple[int, int] | None = None
    media_resumable: bool = False
    priority: int = 0

    @property
    def first_uncached(self) -> int:
        """The first prompt token to prefill (rule 7)."""
        start = max(0, min(self.cached_tokens, self.prompt_tokens - 1))
        span = self.media_span
        if span is not None and span[0] < start <= span[1] and not self.media_resumable:
            start = span[0]
        return start

    @property
    def tokens_to_prefill(self) -> int:
        return self.prompt_tokens - self.first_uncached


@dataclass(frozen=True)
class Prefilling:
    """A prompt being prefilled a chunk per step: its row and the prompt tokens already in
    (the next chunk starts there)."""

    seq: SeqState
    done: int


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens ``[start, end)`` of the row being chunked; after the ``final`` one the
    row joins the running batch."""

    start: int
    end: int
    final: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    """One step. ``admit``: the prompt tokens each of the oldest ``len(admit)`` waiting rows
    prefills; they leave the waiting queue and are prefilled together. ``chunk``: the step's
    chunk of a prompt over the token budget; ``starts_chunk``: it is the first chunk of the
    oldest waiting row (which leaves the queue), else the next of the row being chunked
    (a prompt over the budget, or over the long-prefill threshold while rows run).
    ``decode_rows``: the rows that then take a decode step (those running and those that
    join, when every prefill succeeds)."""

    admit: tuple[int, ...] = ()
    chunk: Chunk | None = None
    starts_chunk: bool = False
    decode_rows: int = 0

    @property
    def admitted(self) -> int:
        """Rows leaving the waiting queue this step."""
        return len(self.admit) + self.starts_chunk

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed this step."""
        return sum(self.admit) + (self.chunk.tokens if self.chunk is not None else 0)


def plan(waiting: Iterable[SeqState], running: int, config: EngineConfig,
         prefilling: Prefilling | None = None) -> StepPlan:
    """The next step, from the waiting rows (oldest first; read only as far as needed), the
    number of rows in the running batch, the settings and the prompt being chunked, if any."""
    budget = config.token_budget
    limit = chunk_limit(config, running)  # rule 5
    if prefilling is not None:  # rule 1
        chunk = next_chunk(prefilling.seq, prefilling.done, limit)
        return StepPlan(chunk=chunk, decode_rows=running + chunk.final)
    if config.scheduling == "static" and running:  # rule 2
        return StepPlan(decode_rows=running)
    admit: list[int] = []
    total = 0
    for seq in waiting:  # rule 3
        if running + len(admit) >= config.max_num_seqs:
            break
        size = seq.tokens_to_prefill
        if total + size > budget or size > limit:  # rules 4 and 5
            if not admit:
                chunk = next_chunk(seq, seq.first_uncached, limit)
                return StepPlan(chunk=chunk, starts_chunk=True,
                                decode_rows=running + chunk.final)
            break
        admit.append(size)
        total += size
    return StepPlan(admit=tuple(admit), decode_rows=running + len(admit))


def serving_order(waiting: Sequence[SeqState], policy: SchedulingPolicy,
                  overtaken: Sequence[int] = (), loads: Sequence[int] = ()) -> list[int]:
    """The indices of ``waiting`` (oldest first) in the order ``policy`` lets them join
    (rule 3). A row that ``overtaken`` (per row, 0 when left out) says was passed over
    :data:`MAX_OVERTAKES` times or more goes before the rest, under every policy (aging: a
    row waits for at most that many steps in which a younger row joined). Then "fcfs" as
    they came, "priority" by ``priority``, lowest first, "shortest" by
    ``tokens_to_prefill``, fewest first; within each, the row whose group has the fewest
    rows running or ahead of it (``loads``, :func:`group_loads`; 0 when left out) first.
    Equals keep their age order (the sort is stable)."""
    count = len(waiting)
    passed = list(overtaken) + [0] * (count - len(overtaken))
    load = list(loads) + [0] * (count - len(loads))

    def policy_key(i: int) -> int:
        if policy == "priority":
            return waiting[i].priority
        if policy == "shortest":
            return waiting[i].tokens_to_prefill
        return 0

    return sorted(range(count), key=lambda i: (0, 0, load[i]) if passed[i] >= MAX_OVERTAKES
                  else (1, policy_key(i), load[i]))


def group_loads(groups: Sequence[str], running: Mapping[str, int]) -> list[int]:
    """Per waiting row (``groups``: each row's group, oldest first), how many rows of its
    group are running (``running``) or waiting ahead of it: the fair-share key of
    :func:`serving_order`. A group's k-th waiting row goes with every other group's k-th."""
    seen: dict[str, int] = {}
    loads = []
    for group in groups:
        ahead = seen.get(group, 0)
        loads.append(running.get(group, 0) + ahead)
        seen[group] = ahead + 1
    return loads


def passed_over(order: Sequence[int], joined: int) -> list[int]:
    """The rows (indices of the waiting rows by age, as :func:`serving_order` takes them)
    that a younger row overtook when the first ``joined`` of ``order`` joined: those left
    waiting that are older than one that joined."""
    if not joined:
        return []
    youngest = max(order[:joined])
    return [i for i in order[joined:] if i < youngest]


def one_group(waiting: Sequence[Row], running_groups: Mapping[str, int]) -> bool:
    """Every waiting row is of one group, and no other group's row runs (fairness has
    nothing to reorder)."""
    groups = {r.request.fair_group for r in waiting}
    return len(groups) == 1 and set(running_groups) <= groups


class Scheduler:
    """What the engine asks for each step: :func:`plan` over its waiting rows in the order of
    ``scheduling_policy`` (:func:`serving_order`), and the starvation counts that order
    reads: how often a younger row joined before each request's rows (:func:`passed_over`).
    No model: a step's inputs are plain (rows, the scheduler's view of each request)."""

    def __init__(self) -> None:
        #: per request id: how often a younger row joined before its rows (under a policy
        #: other than "fcfs"; dropped with :meth:`forget` when the request ends)
        self.overtaken: dict[str, int] = {}

    def schedule(self, waiting: Sequence[Row], running: int, config: EngineConfig,
                 seqs: Mapping[str, SeqState], current: Callable[[Row], SeqState],
                 progress: Prefilling | None = None,
                 running_groups: Mapping[str, int] | None = None
                 ) -> tuple[StepPlan, list[Row] | None]:
        """The next step (see :func:`plan`) for the ``waiting`` rows (oldest first) beside
        ``running`` rows and the prompt being chunked (``progress``), and the waiting rows in
        the order the plan takes them (None: oldest first). ``seqs``: each request's
        :class:`SeqState` as it was submitted; ``current``: a row's with the prompt tokens
        the prefix cache holds now (read lazily: only for the rows the plan looks at);
        ``running_groups``: rows running per group (a client request's sequences), so that
        each group's k-th waiting row goes with every other group's k-th (fairness per
        sequence, :func:`group_loads`)."""
        policy = config.scheduling_policy
        groups = running_groups or {}
        if progress is not None or len(waiting) < 2 or running >= config.max_num_seqs or (
                policy == "fcfs" and not self.overtaken and one_group(waiting, groups)):
            return plan((current(r) for r in waiting), running, config, progress), None
        rows = list(waiting)
        # only "shortest" orders by what the prefix cache leaves: it reads the cache for every
        # row once, here; the others read it lazily, for the rows the plan looks at
        shortest = policy == "shortest"
        views = [current(r) if shortest else seqs[r.request.request_id] for r in rows]
        order = serving_order(views, policy, [self.overtaken.get(r.request.request_id, 0)
                                              for r in rows],
                              group_loads([r.request.fair_group for r in rows], groups))
        taken = plan((views[i] if shortest else current(rows[i]) for i in order),
                     running, config)
        passed = {rows[i].request.request_id for i in passed_over(order, taken.admitted)}
        for rid in passed:
            self.overtaken[rid] = self.overtaken.get(rid, 0) + 1
        return taken, [rows[i] for i in order]

    def forget(self, request_id: str) -> None:
        """``request_id`` ended: its starvation count goes."""
        self.overtaken.pop(request_id, None)


def chunk_limit(config: EngineConfig, running: int) -> int:
    """The most prompt tokens one chunk (and one prompt joining whole) may take in a step
    beside ``running`` rows: the token budget, or while rows run the long-prefill threshold
    (:attr:`~engine.config.EngineConfig.long_prefill_tokens`) when it is lower and not 0
    (rule 5)."""
    budget = config.token_budget
    threshold = config.long_prefill_tokens
    return threshold if running and 0 < threshold < budget else budget


def next_chunk(seq: SeqState, start: int, budget: int) -> Chunk:
    """The chunk of ``seq``'s prompt from ``start``: ``budget`` tokens (the step's
    :func:`chunk_limit`), or up to the end of the prompt, or past the whole media span when
    it would end inside it (rule 6)."""
    length = seq.prompt_tokens
    end = min(start + budget, length)
    span = seq.media_span
    if span is not None and start <= span[1] and span[0] < end <= span[1]:
        end = span[1] + 1
    return Chunk(start, end, end == length)


def chunk_bounds(length: int, budget: int, media: tuple[int, int] | None
                 ) -> list[tuple[int, int]]:
    """Every ``[start, end)`` chunk of an uncached prompt of ``length`` tokens, in order."""
    seq = SeqState(length, media_span=media)
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < length:
        chunk = next_chunk(seq, start, budget)
        bounds.append((chunk.start, chunk.end))
        start = chunk.end
    return bounds


#: how much padding a prefill pass may compute, over its rows' own tokens (see length_groups)
PADDING_SLACK = 0.15


def length_groups(lengths: list[int], slack: float = PADDING_SLACK,
                  max_tokens: int | None = None) -> list[list[int]]:
    """The rows (indices into ``lengths``, the tokens each prefills) grouped into forward
    passes, shortest first, so that no pass computes more than ``slack`` of its rows' tokens
    as padding: left padding to the longest row is work thrown away (a 240-token image row
    beside a 790-token video row costs three times its own tokens). ``max_tokens``: nor more
    than that many tokens, padding included (a row over it alone is one pass): on a CPU a
    pass of a few hundred tokens already runs the products at full speed, so one pass per
    row costs what one pass over all would, and the first rows' first tokens go out sooner
    (each pass hands its own out)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups:
            # sorted ascending: row i is the group's longest once it joins
            padded = (len(groups[-1]) + 1) * lengths[i]
            if padded <= (1 + slack) * (total + lengths[i]) and (
                    max_tokens is None or padded <= max_tokens):
                groups[-1].append(i)
                total += lengths[i]
                continue
        groups.append([i])
        total = lengths[i]
    return groups
