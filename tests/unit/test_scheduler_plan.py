"""The scheduler's rules, model-free: each test builds waiting rows as plain numbers and asserts
the plan (:mod:`engine.executor.scheduler`). The model-backed tests (tests/engine/test_scheduler.py)
check that the engine executing these plans gives each row the logits it gets alone."""

from __future__ import annotations

import pytest

from engine.config import MAX_OVERTAKES, EngineConfig
from engine.errors import ConfigError
from engine.executor.scheduler import (
    Chunk,
    Prefilling,
    SeqState,
    StepPlan,
    chunk_bounds,
    next_chunk,
    passed_over,
    plan,
    serving_order,
)


def seqs(*lengths: int) -> list[SeqState]:
    return [SeqState(n) for n in lengths]


def config(**settings) -> EngineConfig:
    return EngineConfig(**settings)


def test_fcfs_admits_the_oldest_rows_while_the_batch_has_room():
    step = plan(seqs(10, 20, 30, 40, 50), running=2, config=config(max_num_seqs=4))
    assert step == StepPlan(admit=(10, 20), decode_rows=4)
    assert step.admitted == 2 and step.prefill_tokens == 30


def test_a_full_batch_admits_nothing_and_decodes():
    assert plan(seqs(10), running=4, config=config(max_num_seqs=4)) == StepPlan(decode_rows=4)
    assert plan([], running=0, config=config()) == StepPlan()


def test_a_requests_n_samples_are_n_rows_against_max_num_seqs():
    """n=3 enters as three rows of the same prompt: with room for two, two join (each
    prefilling the whole prompt), the third waits."""
    row = SeqState(12)
    step = plan([row] * 3 + seqs(5), running=0, config=config(max_num_seqs=2))
    assert step.admit == (12, 12) and step.decode_rows == 2


def test_the_token_budget_splits_a_join_and_no_row_overtakes_an_older_one():
    budget = config(max_num_batched_tokens=64)
    assert plan(seqs(30, 30, 30), running=0, config=budget).admit == (30, 30)
    # the 50 does not fit beside the 30; the 10 behind it would, but waits its turn
    assert plan(seqs(30, 50, 10), running=1, config=budget) == StepPlan(admit=(30,),
                                                                        decode_rows=2)
    assert plan(seqs(64), running=0, config=budget).admit == (64,)  # exactly the budget


def test_a_large_budget_lets_every_row_that_has_room_join():
    assert plan(seqs(5000, 7000, 9000), running=0, config=config(
        max_num_batched_tokens=1 << 20)).admit == (5000, 7000, 9000)


def test_a_prompt_over_the_budget_alone_starts_a_chunked_prefill():
    step = plan(seqs(200, 10), running=3, config=config(max_num_batched_tokens=64))
    assert step == StepPlan(chunk=Chunk(0, 64, final=False), starts_chunk=True, decode_rows=3)
    assert step.admitted == 1 and step.prefill_tokens == 64


def test_a_prompt_over_the_budget_behind_others_waits_for_the_next_step():
    step = plan(seqs(20, 200), running=0, config=config(max_num_batched_tokens=64))
    assert step == StepPlan(admit=(20,), decode_rows=1)


def test_a_chunked_prefill_continues_alone_and_joins_after_its_last_chunk():
    long = SeqState(150)
    budget = config(max_num_batched_tokens=64)
    middle = plan(seqs(5, 5), running=2, config=budget, prefilling=Prefilling(long, 64))
    assert middle == StepPlan(chunk=Chunk(64, 128, final=False), decode_rows=2)
    assert middle.admitted == 0  # the short ones wait, though they would fit
    last = plan(seqs(5), running=2, config=budget, prefilling=Prefilling(long, 128))
    assert last == StepPlan(chunk=Chunk(128, 150, final=True), decode_rows=3)


def test_a_chunk_never_ends_inside_the_media_span():
    prompt = SeqState(300, media_span=(100, 180))
    assert next_chunk(prompt, 0, 64) == Chunk(0, 64, final=False)  # the span starts after
    assert next_chunk(prompt, 64, 64) == Chunk(64, 181, final=False)  # the span whole
    assert next_chunk(prompt, 181, 64) == Chunk(181, 245, final=False)
    assert chunk_bounds(10, 4, None) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(20, 4, (5, 11)) == [(0, 4), (4, 12), (12, 16), (16, 20)]
    assert chunk_bounds(20, 4, (4, 7)) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    assert chunk_bounds(6, 64, (0, 5)) == [(0, 6)]
    assert chunk_bounds(6, 4, (0, 5)) == [(0, 6)]  # one chunk over the budget: the media
    step = plan([SeqState(100, media_span=(10, 90))], running=0,
                config=config(max_num_batched_tokens=40))
    assert step.chunk == Chunk(0, 91, final=False)


def test_static_scheduling_admits_only_into_an_empty_batch():
    static = config(scheduling="static", max_num_seqs=8, max_num_batched_tokens=64)
    assert plan(seqs(10, 10), running=1, config=static) == StepPlan(decode_rows=1)
    assert plan(seqs(10, 10), running=0, config=static).admit == (10, 10)
    # a chunked prefill started into an empty batch runs to its end
    assert plan(seqs(10), running=0, config=static,
                prefilling=Prefilling(SeqState(100), 64)).chunk == Chunk(64, 100, final=True)


def test_cached_prompt_tokens_are_neither_prefilled_nor_charged_to_the_budget():
    budget = config(max_num_batched_tokens=64)
    warm = SeqState(100, cached_tokens=60)
    assert warm.first_uncached == 60 and warm.tokens_to_prefill == 40
    assert plan([warm, SeqState(20)], running=0, config=budget).admit == (40, 20)
    # all of it cached: the last token is still computed (its logits give the first token)
    assert SeqState(100, cached_tokens=100).tokens_to_prefill == 1
    assert SeqState(100, cached_tokens=500).first_uncached == 99
    # a cached prefix ending inside the media span is cut back to the span's start
    assert SeqState(100, cached_tokens=30, media_span=(20, 50)).first_uncached == 20
    assert SeqState(100, cached_tokens=20, media_span=(20, 50)).first_uncached == 20
    assert SeqState(100, cached_tokens=51, media_span=(20, 50)).first_uncached == 51
    # unless the model resumes inside it (from its merged embeddings)
    resumable = SeqState(100, cached_tokens=30, media_span=(20, 50), media_resumable=True)
    assert resumable.first_uncached == 30 and resumable.tokens_to_prefill == 70
    # and its first chunk still ends past the span (the rest of the item's tokens in one pass)
    assert plan([resumable], running=0, config=config(max_num_batched_tokens=8)).chunk == \
        Chunk(30, 51, final=False)
    # a chunked prefill of a partly cached prompt starts after the cached part
    step = plan([SeqState(300, cached_tokens=100)], running=0, config=budget)
    assert step.chunk == Chunk(100, 164, final=False) and step.starts_chunk


def test_a_request_whose_prefix_is_cached_fits_a_budget_its_full_length_would_not():
    budget = config(max_num_batched_tokens=64)
    # uncached, 100 tokens are over the budget: a chunked prefill of the first 64
    cold = plan([SeqState(100)], running=0, config=budget)
    assert cold.starts_chunk and cold.chunk == Chunk(0, 64, final=False) and not cold.admit
    # with 48 of them cached only 52 are prefilled: it joins in one step, charged 52 (the
    # next row, 20 more, waits)
    warm = plan([SeqState(100, cached_tokens=48), SeqState(20)], running=0, config=budget)
    assert warm.admit == (52,) and warm.chunk is None and warm.prefill_tokens == 52
    # two cached rows of one budget together; their full lengths would not both fit
    pair = plan([SeqState(60, cached_tokens=32), SeqState(60, cached_tokens=32)], running=0,
                config=budget)
    assert pair.admit == (28, 28) and pair.prefill_tokens == 56


def test_the_runners_usable_prefix_is_the_schedulers_first_uncached_token():
    """The engine sets ``cached_tokens`` from the prefix cache's usable prefix: the scheduler
    starts the prefill exactly where the runner's cache leaves off."""
    from engine.executor.prefix_cache import usable_prefix

    for cached, length, span in [(48, 48, None), (48, 49, None), (48, 100, (20, 40)),
                                 (32, 100, (20, 40)), (16, 100, (16, 40)), (0, 7, None)]:
        for inside in (False, True):
            usable = usable_prefix(cached, length, span, 16, inside_media=inside)
            seq = SeqState(length, cached_tokens=usable, media_span=span,
                           media_resumable=inside)
            assert seq.first_uncached == usable and seq.tokens_to_prefill == length - usable


def test_the_waiting_queue_is_read_only_as_far_as_needed():
    """The engine hands its whole queue over; a step reads one row past those that join."""
    read = []

    def waiting():
        for i in range(10_000):
            read.append(i)
            yield SeqState(10)

    assert plan(waiting(), running=5, config=config(max_num_seqs=8)).admit == (10, 10, 10)
    assert len(read) <= 4
    read.clear()
    assert plan(waiting(), running=8, config=config(max_num_seqs=8)).admit == ()
    assert len(read) <= 1


def test_without_a_token_budget_the_devices_default_applies_as_in_vllm():
    """No --max-num-batched-tokens: vLLM's OpenAI-server defaults, 2048 prompt tokens per
    step on a CPU and 8192 on a GPU; a burst of prompts is admitted a budget's worth at a
    time, and a prompt over it is chunked."""
    assert config().token_budget == 2048
    assert config(device="cuda:1").token_budget == 8192
    assert config(max_num_batched_tokens=100).token_budget == 100
    burst = plan(seqs(800, 800, 800, 800), running=0, config=config(max_num_seqs=8))
    assert burst.admit == (800, 800)
    gpu = plan(seqs(800, 800, 800, 800), running=0, config=config(device="cuda",
                                                                    max_num_seqs=8))
    assert gpu.admit == (800, 800, 800, 800)
    long = plan(seqs(5000), running=0, config=config())
    assert long.chunk is not None and long.chunk.tokens == 2048
    step = plan([], running=0, config=config(), prefilling=Prefilling(SeqState(3000), 2048))
    assert (step.chunk.start, step.chunk.end) == (2048, 3000)


def test_fcfs_serves_the_waiting_rows_as_they_came_whatever_their_size_or_priority():
    rows = [SeqState(900, priority=5), SeqState(10, priority=-1), SeqState(300)]
    assert serving_order(rows, "fcfs", [9, 9, 9]) == [0, 1, 2]


def test_priority_serves_the_lowest_value_first_and_the_oldest_among_equals():
    """vLLM's rule: lower priority values are handled earlier; equal ones by arrival."""
    rows = [SeqState(10, priority=2), SeqState(10, priority=0), SeqState(10, priority=-3),
            SeqState(10, priority=0), SeqState(10, priority=2)]
    assert serving_order(rows, "priority") == [2, 1, 3, 0, 4]


def test_shortest_serves_the_fewest_tokens_left_to_prefill_first():
    """Tokens left after the prefix cache count, not the prompt's length: a long prompt
    whose prefix is cached is cheap. Equals keep their age order, so a request's n rows stay
    together."""
    rows = [SeqState(900), SeqState(300), SeqState(2000, cached_tokens=1984),
            SeqState(300), SeqState(40)]
    assert [rows[i].tokens_to_prefill for i in serving_order(rows, "shortest")] == \
        [16, 40, 300, 300, 900]
    assert serving_order(rows, "shortest") == [2, 4, 1, 3, 0]


def test_shortest_lets_a_row_passed_over_too_often_go_first():
    """A video prompt is overtaken by at most MAX_OVERTAKES shorter ones, then goes before
    every younger row, the oldest such row first."""
    rows = [SeqState(900), SeqState(800), SeqState(10), SeqState(20)]
    assert serving_order(rows, "shortest", [MAX_OVERTAKES - 1, 0]) == [2, 3, 1, 0]
    assert serving_order(rows, "shortest", [MAX_OVERTAKES, 0, 0, 0]) == [0, 2, 3, 1]
    assert serving_order(rows, "shortest", [MAX_OVERTAKES + 2, MAX_OVERTAKES]) == \
        [0, 1, 2, 3]


def test_passed_over_counts_the_older_rows_a_younger_one_joined_before():
    order = [2, 4, 1, 3, 0]  # (the shortest-first order above)
    assert passed_over(order, 0) == []
    assert passed_over(order, 1) == [1, 0]  # row 2 joined: rows 0 and 1 are older
    assert passed_over(order, 2) == [1, 3, 0]  # rows 2 and 4 joined
    assert passed_over([0, 1, 2], 2) == []  # first come, first served passes nobody


def test_the_policy_order_then_meets_the_budget_and_the_batch_room():
    """The plan takes the waiting rows in the policy's order: the short rows join first, the
    long one waits for room in the token budget."""
    rows = [SeqState(900), SeqState(300), SeqState(200)]
    order = serving_order(rows, "shortest")
    step = plan([rows[i] for i in order], running=0,
                config=config(max_num_batched_tokens=1000))
    assert step.admit == (200, 300)
    assert passed_over(order, step.admitted) == [0]


def test_an_unknown_scheduling_policy_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--scheduling-policy 'sjf'"):
        EngineConfig(scheduling_policy="sjf")  # type: ignore[arg-type]


# -- long prefills (--long-prefill-token-threshold) ----------------------------------------


def test_a_prompt_over_the_long_prefill_threshold_is_chunked_while_rows_run():
    """Under the budget but over the threshold, with rows decoding: chunks of at most the
    threshold, the running rows decoding after each (vLLM's --long-prefill-token-threshold)."""
    long = config(max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    step = plan(seqs(1500, 10), running=3, config=long)
    assert step == StepPlan(chunk=Chunk(0, 512, final=False), starts_chunk=True,
                            decode_rows=3)
    middle = plan(seqs(10), running=3, config=long, prefilling=Prefilling(SeqState(1500), 512))
    assert middle == StepPlan(chunk=Chunk(512, 1024, final=False), decode_rows=3)
    last = plan(seqs(10), running=3, config=long, prefilling=Prefilling(SeqState(1500), 1024))
    assert last == StepPlan(chunk=Chunk(1024, 1500, final=True), decode_rows=4)
    # at or under the threshold it joins whole, with the rows ahead of it that fit
    assert plan(seqs(100, 512), running=3, config=long).admit == (100, 512)
    # behind a row that joins it waits for the next step (and then starts its chunks)
    assert plan(seqs(100, 1500), running=3, config=long) == StepPlan(admit=(100,),
                                                                      decode_rows=4)
    # only its uncached tokens count, and its chunks start after them
    warm = SeqState(1500, cached_tokens=1024)
    assert plan([warm], running=3, config=long).admit == (476,)
    assert plan([SeqState(1500, cached_tokens=256)], running=3, config=long).chunk == \
        Chunk(256, 768, final=False)


def test_with_nothing_running_a_long_prompt_is_prefilled_whole_up_to_the_budget():
    long = config(max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    assert plan(seqs(1500, 300), running=0, config=long).admit == (1500, 300)
    # over the budget it is chunked by the budget, as without a threshold
    assert plan(seqs(3000), running=0, config=long).chunk == Chunk(0, 2048, final=False)
    # a chunked prefill whose running rows all ended goes on in budget-sized chunks
    assert plan([], running=0, config=long, prefilling=Prefilling(SeqState(3000), 512)) \
        .chunk == Chunk(512, 2560, final=False)
    # and one started over the budget takes threshold-sized chunks while rows run
    assert plan([], running=1, config=long, prefilling=Prefilling(SeqState(3000), 2048)) \
        .chunk == Chunk(2048, 2560, final=False)


def test_a_long_prefill_chunk_keeps_the_media_span_whole():
    long = config(long_prefill_token_threshold=64)
    prompt = SeqState(300, media_span=(50, 180))
    first = plan([prompt], running=2, config=long)
    assert first.chunk == Chunk(0, 181, final=False) and first.starts_chunk
    assert plan([], running=2, config=long, prefilling=Prefilling(prompt, 181)).chunk == \
        Chunk(181, 245, final=False)
    # a span that runs to the prompt's end: the chunk that reaches it holds all the rest
    tail = SeqState(200, media_span=(30, 199))
    assert plan([tail], running=2, config=long) == StepPlan(
        chunk=Chunk(0, 200, final=True), starts_chunk=True, decode_rows=3)


def test_a_long_prefill_threshold_of_zero_or_over_the_budget_changes_nothing():
    for off in (config(long_prefill_token_threshold=0),
                config(max_num_batched_tokens=1000, long_prefill_token_threshold=4000)):
        assert plan(seqs(900), running=3, config=off).admit == (900,)
        assert plan([], running=3, config=off, prefilling=Prefilling(SeqState(5000), 0)) \
            .chunk.tokens == off.token_budget
    # a GPU's default is off; a CPU's is on
    assert config(device="cuda").long_prefill_tokens == 0
    assert plan(seqs(1500), running=3, config=config(device="cuda")).admit == (1500,)
    assert config().long_prefill_tokens == 512
    assert plan(seqs(1500), running=3, config=config()).chunk == Chunk(0, 512, final=False)
