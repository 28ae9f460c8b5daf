"""Fairness per sequence and the bound on waiting, model-free: a step loop that does what
the engine does with the scheduler's pure functions (order the waiting rows, plan, count
who was passed over, decode one token per running row), and one check on the real engine
with the tiny model. Rules: the rows of one client request (its prompts times ``n``: a
group) are interleaved with other groups', so a small request beside a big one ends within
a bounded number of steps; under ``priority`` a row passed over MAX_OVERTAKES times joins
next, whatever keeps arriving."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from engine.config import MAX_OVERTAKES, EngineConfig
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from engine.executor.scheduler import (
    SeqState,
    group_loads,
    passed_over,
    plan,
    serving_order,
)
from tests.engine_fixtures import llm


@dataclass
class Row:
    name: str
    group: str
    tokens_left: int
    priority: int = 0


class Loop:
    """The engine's step loop over plain rows: rows join in the policy's order (with the
    group loads and the overtaken counts the engine keeps), then every running row decodes
    one token; a row leaves once its tokens are out."""

    def __init__(self, policy: str, max_num_seqs: int) -> None:
        self.policy = policy
        self.config = EngineConfig(max_num_seqs=max_num_seqs, scheduling_policy=policy)
        self.waiting: list[Row] = []
        self.running: list[Row] = []
        self.overtaken: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.ended: dict[str, int] = {}

    def step(self) -> None:
        seqs = [SeqState(8, priority=r.priority) for r in self.waiting]
        running = collections.Counter(r.group for r in self.running)
        order = serving_order(seqs, self.policy, [self.overtaken[r.name] for r in self.waiting],
                              group_loads([r.group for r in self.waiting], running))
        taken = plan([seqs[i] for i in order], len(self.running), self.config)
        for i in passed_over(order, taken.admitted):
            self.overtaken[self.waiting[i].name] += 1
        joined = [self.waiting[i] for i in order[:taken.admitted]]
        self.waiting = [r for r in self.waiting if r not in joined]
        self.running += joined
        self.steps += 1
        for row in self.running:
            row.tokens_left -= 1
            if row.tokens_left == 0:
                self.ended[row.name] = self.steps
        self.running = [r for r in self.running if r.tokens_left > 0]


def test_a_small_request_beside_a_big_one_ends_within_a_bounded_number_of_steps():
    """64 prompts x n=16 of one request (1024 rows of 8 tokens, 4 rows at a time), then a
    2-token request from another client: it joins as soon as a row leaves (one row's
    tokens, 8 steps, plus its own 2), not after the big request's 2048 steps. The big one
    still gets the batch the rest of the time."""
    loop = Loop("fcfs", max_num_seqs=4)
    loop.waiting = [Row(f"big-{p}-{k}", "big", 8) for p in range(64) for k in range(16)]
    loop.step()
    loop.waiting.append(Row("small", "small", 2))
    while "small" not in loop.ended:
        loop.step()
    assert loop.ended["small"] <= 1 + 8 + 2
    while loop.waiting or loop.running:
        loop.step()
    assert loop.steps <= 1024 * 8 // 4 + 2


def test_groups_share_the_batch_row_for_row():
    """Two big requests sent one after the other take the batch's rows in turns (not the
    first all of them), and their rows of one group keep their age order."""
    loop = Loop("fcfs", max_num_seqs=4)
    loop.waiting = [Row(f"a{i}", "a", 3) for i in range(8)] + \
        [Row(f"b{i}", "b", 3) for i in range(8)]
    loop.step()
    assert collections.Counter(r.group for r in loop.running) == {"a": 2, "b": 2}
    assert [r.name for r in loop.running] == ["a0", "b0", "a1", "b1"]


def test_group_loads_count_running_rows_and_those_ahead():
    assert group_loads(["a", "a", "b", "a", "b"], {"a": 2}) == [2, 3, 0, 4, 1]


def test_priority_serves_a_low_priority_row_while_higher_ones_keep_coming():
    """Under --scheduling-policy priority a row waits for at most MAX_OVERTAKES steps in
    which a younger row joined before it (aging, as "shortest" has): one high-priority row
    arrives every step, for ever, and one row fits the batch at a time."""
    loop = Loop("priority", max_num_seqs=1)
    loop.waiting = [Row("low", "low", 1, priority=10)]
    for i in range(4 * MAX_OVERTAKES):
        loop.waiting.append(Row(f"high-{i}", f"high-{i}", 1, priority=-5))
        loop.step()
        if "low" in loop.ended:
            break
    assert loop.ended.get("low") == MAX_OVERTAKES + 1


def test_an_aged_row_goes_first_under_priority_as_under_shortest():
    rows = [SeqState(10, priority=9), SeqState(10, priority=0), SeqState(10, priority=-1)]
    assert serving_order(rows, "priority") == [2, 1, 0]
    assert serving_order(rows, "priority", [MAX_OVERTAKES]) == [0, 2, 1]


def test_the_engine_interleaves_a_small_request_with_a_big_ones_rows():
    """The real engine (tiny model, 2 rows at a time): a big request's 8 prompts x n=4 (one
    group, 32 rows of 6 tokens), then a 2-token request: the small one ends within a few
    steps of the big rows running when it came (today: after all 32 rows)."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=2))
    try:
        prompt = model.prepare("A big request's prompt.", [], None, raw=True)[1]
        big = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=4)
        bigs = [engine.submit(EngineRequest(prompt, big, group="big")) for _ in range(8)]
        small = engine.submit(EngineRequest(prompt, SamplingParams(
            max_tokens=2, temperature=0, ignore_eos=True), group="small"))
        assert small.done.wait(120) and small.error is None
        finished = sum(len([o for o in r.outputs if o.finish_reason]) for r in bigs)
        assert finished <= 4, f"{finished} of the big request's 32 rows ended first"
        for req in bigs:
            assert req.done.wait(120) and req.error is None
    finally:
        engine.close()
