"""The engine's request lifecycle with a fake runner (tests/fake_runner.py): no model, no
torch, milliseconds. Endings (max_tokens, EOS, stop strings across tokens, cancellation),
``n`` > 1, a failure in a prefill or a decode step kept to its own request, chunked prefill,
``max_num_seqs`` and every scheduling policy. The model-backed tests (test_scheduler.py,
test_generation_endings.py, ...) keep the numerical checks."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.config import MAX_OVERTAKES, EngineConfig
from engine.errors import InternalError
from engine.executor.engine import Engine
from engine.executor.request import CompletionOutput, EngineRequest, TokenEvent
from engine.executor.row import Row
from engine.executor.sampling import SamplingParams
from engine.executor.stop import Stop, check_stop
from engine.processing.preprocess import ProcessedPrompt
from tests.fake_runner import EOS, MEDIA, OP, SPACE, ST, FakeRunner, held

WAIT_S = 5.0


def request(first: int = 0, length: int = 4, *, script: list | None = None,
            priority: int = 0, media: tuple[int, int] | None = None,
            **params: object) -> EngineRequest:
    """A request whose prompt starts with token ``first`` (its rows' letters start there)
    and is ``length`` tokens long (``media``: a span of media tokens in it)."""
    ids = [first] + [SPACE] * (length - 1)
    if media is not None:
        ids[media[0]:media[1] + 1] = [MEDIA] * (media[1] + 1 - media[0])
    prompt = ProcessedPrompt(input_ids=ids, mm={}, item_hits=[], timings={},
                             modality_counts={})
    events: list[TokenEvent] = []
    req = EngineRequest(prompt, SamplingParams(**params), on_event=events.append,
                        priority=priority)
    req.extra["events"] = events
    if script is not None:
        req.extra["script"] = script
    return req


def texts(req: EngineRequest) -> list[str]:
    return [out.text for out in req.outputs]


def streamed(req: EngineRequest, index: int = 0) -> str:
    return "".join(e.text_delta for e in req.extra["events"] if e.index == index)


def finished(*reqs: EngineRequest) -> None:
    for req in reqs:
        assert req.done.wait(WAIT_S), f"{req.request_id} did not finish"


def run_together(engine: Engine, *reqs: EngineRequest) -> None:
    """Submit ``reqs`` so that they enter the waiting queue together, in this order, and wait
    until every one finished."""
    with held(engine):
        for req in reqs:
            engine.submit(req)
    finished(*reqs)


@pytest.fixture
def start() -> Iterator:
    """``start(config=..., **runner_kwargs)``: an engine over a fake runner (closed after)."""
    engines: list[Engine] = []

    def make(config: EngineConfig | None = None, **kwargs: object) -> tuple[Engine, FakeRunner]:
        runner = FakeRunner(**kwargs)
        engine = Engine(None, config or EngineConfig(), runner=runner, batch_wait_s=0.001)
        engines.append(engine)
        return engine, runner

    yield make
    for engine in engines:
        engine.close()


# -- check_stop, pure --------------------------------------------------------------------


def _row(tokens: int = 0, **params: object) -> Row:
    req = request(**params)
    req.outputs = [CompletionOutput(0)]
    return Row(req, 0, None, token_ids=list(range(tokens)))


def test_check_stop_decides_from_the_row_alone_in_its_order() -> None:
    assert check_stop(_row(), 3, eos_ids={EOS}) is None
    # an EOS, a stop token or a grammar's last token is part of the output (counted, as vLLM
    # counts it) without its text
    assert check_stop(_row(), EOS, eos_ids={EOS}) == Stop("stop", silent=True)
    assert check_stop(_row(ignore_eos=True), EOS, eos_ids={EOS}) is None
    assert check_stop(_row(), 3, eos_ids={EOS}, grammar_complete=True) == Stop(
        "stop", silent=True)
    # vLLM's stop_reason: a stop token's id; EOS (checked first) has none
    assert check_stop(_row(stop_token_ids=[3]), 3, eos_ids={EOS}) == Stop(
        "stop", stop_reason=3, silent=True)
    assert check_stop(_row(stop_token_ids=[EOS]), EOS, eos_ids={EOS}).stop_reason is None
    assert check_stop(_row(stop_token_ids=[EOS], ignore_eos=True), EOS,
                      eos_ids={EOS}).stop_reason == EOS
    # the max_tokens-th token ends the row and is part of its output, with its text
    assert check_stop(_row(2, max_tokens=3), 3, eos_ids={EOS}) == Stop("length", True)
    assert not check_stop(_row(2, max_tokens=3), 3, eos_ids={EOS}).silent
    assert check_stop(_row(1, max_tokens=3), 3, eos_ids={EOS}) is None
    # cancellation comes first: an EOS or a last token of a cancelled row is not its own end
    row = _row(2, max_tokens=3)
    row.request.cancel()
    assert check_stop(row, EOS, eos_ids={EOS}) == Stop("abort", keeps_token=False)
    assert check_stop(row, 3, eos_ids={EOS}) == Stop("abort", keeps_token=False)


# -- endings -----------------------------------------------------------------------------


def test_a_row_ends_at_max_tokens_with_its_tokens_and_text(start) -> None:
    engine, runner = start()
    req = engine.submit(request(first=2, max_tokens=5))
    finished(req)
    out = req.outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("cdefg", [2, 3, 4, 5, 6], "length")
    assert streamed(req) == "cdefg"
    assert req.error is None and set(req.timings) >= {"queue_s", "first_token_s", "decode_s"}
    # the first token comes from the prefill, the other four from decode steps
    assert len(runner.passes("prefill")) == 1 and len(runner.passes("decode")) == 4


def test_eos_ends_a_row_with_its_token_but_not_its_text_unless_ignore_eos(start) -> None:
    """vLLM's count: the EOS is the output's last token (its usage, its stream's events)
    and adds no text."""
    engine, _ = start()
    stopped = engine.submit(request(script=[0, 1, EOS, 2], max_tokens=10))
    ignored = engine.submit(request(script=[0, EOS, 1, 2], max_tokens=4, ignore_eos=True))
    finished(stopped, ignored)
    assert (stopped.outputs[0].text, stopped.outputs[0].token_ids) == ("ab", [0, 1, EOS])
    assert stopped.outputs[0].finish_reason == "stop"
    events = stopped.extra["events"]
    assert [e.token_id for e in events] == [0, 1, EOS] and events[-1].text_delta == ""
    assert streamed(stopped) == "ab"
    assert (ignored.outputs[0].text, ignored.outputs[0].token_ids) == ("abc", [0, EOS, 1, 2])
    assert ignored.outputs[0].finish_reason == "length"


def test_a_stop_string_across_tokens_ends_the_row_and_is_never_streamed(start) -> None:
    engine, _ = start()
    # "ST" + "OP": the first half is held back until the second shows it is a stop string
    cut = engine.submit(request(script=[0, SPACE, ST, OP, 1], max_tokens=10, stop=["STOP"]))
    # "ST" never completed: held back, then sent when the row ends at max_tokens
    kept = engine.submit(request(script=[0, ST, 1], max_tokens=3, stop=["STOP"]))
    # ... or at EOS (the held text goes out with the end event)
    flushed = engine.submit(request(script=[0, ST, EOS], max_tokens=10, stop=["STOP"]))
    finished(cut, kept, flushed)
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason) == ("a ", "stop")
    assert streamed(cut) == "a " and not any("S" in e.text_delta for e in cut.extra["events"])
    assert (kept.outputs[0].text, kept.outputs[0].finish_reason) == ("aSTb", "length")
    assert streamed(kept) == "aSTb"
    assert (flushed.outputs[0].text, flushed.outputs[0].finish_reason) == ("aST", "stop")
    assert streamed(flushed) == "aST"
    # the EOS's event carries the held text
    assert flushed.extra["events"][-1].token_id == EOS
    assert flushed.extra["events"][-1].text_delta == "aST"  # (3 characters held for "STOP")
    # vLLM's stop_reason: the stop string that ended the row, on its output and end event
    assert (cut.outputs[0].stop_reason, cut.extra["events"][-1].stop_reason) == ("STOP",) * 2
    assert kept.outputs[0].stop_reason is flushed.outputs[0].stop_reason is None


def test_stop_reason_names_the_stop_token_or_the_first_stop_string(start) -> None:
    engine, _ = start()
    token = engine.submit(request(script=[0, 1, 2, 3], max_tokens=10, stop_token_ids=[2]))
    # "b" is listed first, " " starts first: the text is cut at the first to start
    string = engine.submit(request(script=[0, SPACE, 1, 2], max_tokens=10, stop=["b", " "]))
    finished(token, string)
    assert (token.outputs[0].token_ids, token.outputs[0].stop_reason) == ([0, 1, 2], 2)
    assert token.outputs[0].text == "ab"  # (the stop token's text left out)
    assert token.extra["events"][-1].stop_reason == 2
    assert (string.outputs[0].text, string.outputs[0].stop_reason) == ("a", " ")


def test_n_rows_of_a_request_prefill_together_and_end_on_their_own(start) -> None:
    engine, runner = start()
    req = engine.submit(request(first=0, n=3, max_tokens=3))
    short = engine.submit(request(n=2, script=[[0, EOS], [0, 1, 2, 3]], max_tokens=4))
    finished(req, short)
    assert texts(req) == ["abc", "bcd", "cde"]
    assert [o.finish_reason for o in req.outputs] == ["length"] * 3
    assert {streamed(req, i) for i in range(3)} == {"abc", "bcd", "cde"}
    assert [o.finish_reason for o in short.outputs] == ["stop", "length"]
    assert texts(short) == ["a", "abcd"]
    assert runner.passes("prefill")[0].count(req.request_id) == 3


# -- cancellation --------------------------------------------------------------------------


def test_a_cancelled_request_ends_with_abort_and_the_others_go_on(start) -> None:
    engine, runner = start()
    gone = request(max_tokens=1000)
    gone.on_event = lambda event: (gone.extra["events"].append(event),
                                   len(gone.extra["events"]) == 3 and gone.cancel())
    other = request(first=5, max_tokens=20)
    run_together(engine, gone, other)
    assert gone.outputs[0].finish_reason == "abort" and gone.error is None
    assert 3 <= len(gone.outputs[0].token_ids) < 10
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 20
    # no decode step ran the cancelled row after it ended
    last = max(i for i, rows in enumerate(runner.passes("decode")) if gone.request_id in rows)
    assert last < len(runner.passes("decode")) - 1


def test_a_request_cancelled_while_waiting_never_runs(start) -> None:
    engine, runner = start(EngineConfig(max_num_seqs=1))
    first = request(max_tokens=3)
    waiting = request(n=2, max_tokens=3)
    with held(engine):
        engine.submit(first)
        engine.submit(waiting)
        waiting.cancel()
    finished(first, waiting)
    assert [o.finish_reason for o in waiting.outputs] == ["abort", "abort"]
    assert all(waiting.request_id not in rows for _, rows in runner.log)
    assert first.outputs[0].finish_reason == "length"


# -- failures ----------------------------------------------------------------------------


def _failing(kind: str, bad: EngineRequest):
    def fails(pass_kind: str, rows: list[Row]) -> None:
        if pass_kind == kind and any(r.request is bad for r in rows):
            raise RuntimeError("boom")
    return fails


def test_a_failure_in_a_prefill_fails_only_its_request(start) -> None:
    bad = request(first=1, max_tokens=4)
    engine, runner = start(fails=_failing("prefill", bad))
    good = [request(first=0, max_tokens=4), request(first=2, n=2, max_tokens=4)]
    run_together(engine, good[0], bad, good[1])
    assert isinstance(bad.error, InternalError) and bad.error.status == 500
    assert "boom" not in str(bad.error)  # the client sees the type, not the message
    assert texts(good[0]) == ["abcd"] and texts(good[1]) == ["cdef", "defg"]
    # the shared prefill failed, then each request's rows were prefilled alone
    prefills = runner.passes("prefill")
    assert len(prefills[0]) == 4 and [len(p) for p in prefills[1:]] == [1, 1, 2]


def test_a_failure_in_a_later_prefill_pass_keeps_the_earlier_passes_rows(start) -> None:
    # a short and a long prompt prefill in two passes (length_groups), shortest first; the
    # long one's pass fails after the short one's first token was handed on
    bad = request(first=1, length=60, max_tokens=4)
    engine, runner = start(fails=_failing("prefill", bad))
    good = request(first=0, length=4, max_tokens=4)
    run_together(engine, bad, good)
    assert isinstance(bad.error, InternalError)
    assert texts(good) == ["abcd"]  # not prefilled twice: its first token once
    assert runner.passes("prefill") == [[good.request_id], [bad.request_id],
                                        [bad.request_id]]


def test_a_failure_in_a_decode_step_fails_only_its_request(start) -> None:
    bad = request(first=1, max_tokens=6)
    engine, _ = start(fails=_failing("decode", bad))
    good = request(first=0, max_tokens=6)
    run_together(engine, bad, good)
    assert isinstance(bad.error, InternalError) and texts(bad) == ["b"]
    assert texts(good) == ["abcdef"] and good.error is None
    assert engine.running is None and not engine.waiting


def test_a_failure_in_a_chunk_fails_its_request_and_the_running_rows_go_on(start) -> None:
    long = request(first=1, length=20, max_tokens=3)
    engine, runner = start(EngineConfig(max_num_batched_tokens=8), fails=_failing("chunk", long))
    running = request(first=0, max_tokens=6)
    run_together(engine, running, long)
    assert isinstance(long.error, InternalError) and texts(running) == ["abcdef"]
    assert runner.passes("chunk") == [(long.request_id, 0, 8)]  # its first chunk failed


# -- chunked prefill -----------------------------------------------------------------------


def test_a_prompt_over_the_budget_prefills_a_chunk_per_step_between_decode_steps(start):
    engine, runner = start(EngineConfig(max_num_batched_tokens=8))
    running = request(first=0, max_tokens=8)
    long = request(first=3, length=30, media=(6, 17), max_tokens=2)
    run_together(engine, running, long)
    # 8 tokens a chunk, but the one holding the media span (6..17) goes past it (rule 6)
    assert [c[1:] for c in runner.passes("chunk")] == [(0, 18), (18, 26), (26, 30)]
    assert texts(long) == ["de"] and texts(running) == ["abcdefgh"]
    kinds = [k for k, _ in runner.log]
    first, last = kinds.index("chunk"), len(kinds) - 1 - kinds[::-1].index("chunk")
    assert kinds[first:last + 1].count("decode") == 2  # the running row stepped between


def test_a_prompt_over_the_long_prefill_threshold_is_chunked_while_a_row_decodes(start):
    """--long-prefill-token-threshold 8: a 30-token prompt arriving while a row decodes is
    prefilled 8 tokens a chunk (the chunk holding the media span 6..17 past it), the running
    row taking a decode step after each chunk; its answer is the one it gets prefilled whole
    (threshold 0)."""

    def run(threshold: int) -> tuple[FakeRunner, EngineRequest, EngineRequest]:
        running = request(first=0, max_tokens=12)
        long = request(first=3, length=30, media=(6, 17), max_tokens=3)

        sent: list[EngineRequest] = []

        def arrives(kind: str, rows: list[Row]) -> None:  # during the running row's decoding
            if kind == "decode" and not sent:
                sent.append(engine.submit(long))

        engine, runner = start(EngineConfig(long_prefill_token_threshold=threshold),
                               fails=arrives)
        engine.submit(running)
        finished(running, long)
        return runner, running, long

    runner, running, long = run(8)
    assert [c[1:] for c in runner.passes("chunk")] == [(0, 18), (18, 26), (26, 30)]
    kinds = [k for k, _ in runner.log]
    first, last = kinds.index("chunk"), len(kinds) - 1 - kinds[::-1].index("chunk")
    assert kinds[first:last + 1] == ["chunk", "decode", "chunk", "decode", "chunk"]
    assert texts(long) == ["def"] and texts(running) == ["abcdefghijkl"]
    whole, running_whole, long_whole = run(0)
    assert whole.passes("chunk") == [] and [long_whole.request_id] in whole.passes("prefill")
    assert texts(long_whole) == texts(long) and texts(running_whole) == texts(running)


def test_an_engine_that_prefills_beside_its_decode_steps_chunks_no_long_prompt_by_default(
        start) -> None:
    """With --overlap-prefill a long prompt's prefill already runs beside the decode steps:
    the CPU's default threshold gives way (0); a threshold given stays."""
    overlapping, _ = start(EngineConfig(overlap_prefill=True))
    assert overlapping.config.long_prefill_tokens == 0
    assert start(EngineConfig())[0].config.long_prefill_tokens == 512
    given, _ = start(EngineConfig(overlap_prefill=True, long_prefill_token_threshold=256))
    assert given.config.long_prefill_tokens == 256


# -- scheduling ----------------------------------------------------------------------------


def test_max_num_seqs_bounds_the_running_rows(start) -> None:
    engine, runner = start(EngineConfig(max_num_seqs=2))
    reqs = [request(first=i, max_tokens=3) for i in range(5)]
    run_together(engine, *reqs)
    assert [texts(r)[0][0] for r in reqs] == list("abcde")
    sizes = [len(rows) for rows in runner.passes("decode")]
    assert max(sizes) == 2
    assert max(len(rows) for rows in runner.passes("prefill")) == 2


def _admitted(runner: FakeRunner) -> list[str]:
    return [rid for rows in runner.passes("prefill") for rid in rows]


@pytest.mark.parametrize(("policy", "priorities", "order"), [
    ("fcfs", [0, 0, 0, 0], [0, 1, 2, 3]),
    ("priority", [3, 1, 2, 1], [1, 3, 2, 0]),  # lowest first; equals by age
])
def test_the_policy_orders_the_waiting_rows(start, policy, priorities, order) -> None:
    engine, runner = start(EngineConfig(max_num_seqs=1, scheduling_policy=policy))
    reqs = [request(first=i, max_tokens=2, priority=p) for i, p in enumerate(priorities)]
    run_together(engine, *reqs)
    assert _admitted(runner) == [reqs[i].request_id for i in order]


def test_shortest_first_lets_a_long_prompt_be_overtaken_a_bounded_number_of_times(start):
    engine, runner = start(EngineConfig(max_num_seqs=1, scheduling_policy="shortest"))
    long = request(first=0, length=40, max_tokens=1)
    short = [request(first=1, length=4 + i, max_tokens=1) for i in range(MAX_OVERTAKES + 2)]
    run_together(engine, long, *short)
    ids = [r.request_id for r in short]
    assert _admitted(runner) == [*ids[:MAX_OVERTAKES], long.request_id, *ids[MAX_OVERTAKES:]]
    assert engine.scheduler.overtaken == {}  # (nothing left behind for requests gone)


def test_a_prefill_beside_the_decode_steps_joins_whole_or_fails_alone(start) -> None:
    """--overlap-prefill: rows admitted while others run are prefilled on a second thread and
    join at a step boundary; a failure there fails only its request."""
    submitted = threading.Event()
    bad = request(first=1, max_tokens=3)

    def fails(kind: str, rows: list[Row]) -> None:
        if kind == "decode":
            submitted.wait(WAIT_S)  # the first decode step waits for the others to arrive
        elif kind == "prefill" and any(r.request is bad for r in rows):
            raise RuntimeError("boom")

    engine, _ = start(EngineConfig(overlap_prefill=True), fails=fails)
    running = request(first=0, max_tokens=12)
    first_token = threading.Event()
    running.on_event = lambda event: (running.extra["events"].append(event), first_token.set())
    engine.submit(running)
    assert first_token.wait(WAIT_S)  # it runs: the next rows are admitted beside it
    joining = request(first=2, max_tokens=3)
    engine.submit(joining)
    engine.submit(bad)
    submitted.set()
    finished(running, joining, bad)
    assert engine.stats["prefills_overlapped_total"] >= 1
    assert texts(running) == ["abcdefghijkl"] and texts(joining) == ["cde"]
    assert isinstance(bad.error, InternalError) and joining.error is None
