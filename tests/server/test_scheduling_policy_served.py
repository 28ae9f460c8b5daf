"""``serve --scheduling-policy``, end to end with the ``openai`` client: under ``priority``
(vLLM's flag) the waiting requests join the running batch lowest ``priority`` first (the
request field vLLM's clients send in ``extra_body``); a bad ``priority`` is a 400 naming it;
under the default ``fcfs`` a ``priority`` other than 0 is refused naming the flag that
honours it (tests/server/test_completions_prompts.py's server). The order rules themselves are
checked model-free in tests/unit/test_scheduler_plan.py and on the engine in
tests/engine/test_scheduler.py."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import openai
import pytest

from tests.server_harness import ServerProcess, situation

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-qwen2_5_vl"
#: tokens in each queued request's answer: one row at a time, so consecutive answers end this
#: many decode steps apart (32 was too few: at load average 6 the API server delivered
#: answers out of the engine's order, [1, 3, 2, 0, 4], in a run of the server tier)
ANSWER = 128


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1").wait_ready()
    yield proc
    assert proc.stop() == 0


def waiting(server) -> float:
    text = urllib.request.urlopen(f"{server.base}/metrics", timeout=10).read().decode()
    found = re.search(r"^aphrodite_engine_num_rows_waiting(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found, "no waiting-rows gauge on /metrics"
    return float(found.group(1))


def queue_behind_a_holder(server, client, priorities: list[int]) -> list[int] | None:
    """Send one request per priority, one after the other, each while a 4000-token holder
    keeps the one-row batch busy, each seen queued on ``/metrics`` before the next is sent;
    then close the holder and return the order they ended in. None when the holder ended
    before all of them were queued (a loaded machine's slow sends: the order then says
    nothing about the policy), for the caller to try again."""
    holder = client.completions.create(model=MODEL, prompt="Hold the batch", max_tokens=4000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(holder))
    ended: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            out = client.completions.create(model=MODEL, prompt=f"Request {i}", max_tokens=ANSWER,
                                            temperature=0, extra_body={
                                                "ignore_eos": True, "priority": priorities[i]})
            assert out.usage.completion_tokens == ANSWER
            with lock:
                ended.append(i)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = []
    queued = True
    for i in range(len(priorities)):
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 60  # each in the queue before the next is sent
        while waiting(server) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        if waiting(server) < i + 1:
            queued = False
            print(f"try: request {i} never seen queued; ended so far {ended}, "
                  f"errors {errors}{situation(server)}")
            break
    holder.close()  # the client goes away: its row leaves, the waiting ones join one by one
    for t in threads:
        t.join(120)
    assert not errors, errors
    return ended if queued else None


def test_waiting_requests_join_lowest_priority_first(server):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    # three tries: on a loaded machine the holder can end before all five are queued
    for _ in range(3):
        ended = queue_behind_a_holder(server, client, [4, 0, -3, 0, 9])
        if ended is not None:
            break
    assert ended is not None, "the five requests were never all queued behind the holder"
    # one row at a time: they end in the order they joined (the two 0s as they came); ANSWER
    # tokens each, so a loaded machine's late thread cannot reorder when the answers arrive
    assert ended == [2, 1, 3, 0, 4]


@pytest.mark.parametrize(("priority", "message"), [
    ("high", "priority must be int"), (True, "priority must be a number"),
    (1 << 40, "priority must be an integer from")])
def test_a_bad_priority_is_a_400_naming_it(server, priority, message):
    req = urllib.request.Request(f"{server.base}/v1/chat/completions", data=json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "priority": priority}).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(info.value.read())
    assert info.value.code == 400
    assert body["error"]["param"] == "priority"
    assert message in body["error"]["message"]
