"""--max-pending-requests counts sequences (prompts x n) on a real server: one completions
request of 8 prompts x n=8 (64 sequences) is charged half the limit, so another client's
2-token request still finds room and is served while it runs; a big request that finds no room
for its sequences is a 503 with Retry-After naming the flag. (Before: a request counted one
whatever its sequences, and a 2-token request waited 19 s behind 64 prompts x n=16.)"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.server_harness import running, situation

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-qwen2_5_vl"
#: odd: two big requests take half of it each (rounded down), one slot is left
LIMIT = 5


@pytest.fixture(scope="module")
def server():
    with running("--max-pending-requests", str(LIMIT), "--max-num-seqs", "8") as proc:
        yield proc


def post(server, body: dict) -> tuple[int, dict, dict]:
    """(status, headers, JSON answer) of a completions request."""
    req = urllib.request.Request(f"{server.base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def in_flight(server) -> int:
    """The API server's requests in flight, as it charges them (vLLM's running + waiting)."""
    text = urllib.request.urlopen(f"{server.base}/metrics", timeout=30).read().decode()
    return sum(int(float(v)) for v in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


BIG = {"model": MODEL, "prompt": [f"Story number {i}:" for i in range(8)], "n": 8,
       "max_tokens": 64, "ignore_eos": True, "temperature": 1.0}
SMALL = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}  # (2 tokens, always)


def test_a_big_request_leaves_room_for_a_small_one_and_one_past_the_limit_gets_a_503(server):
    answers: dict[str, tuple[int, dict, dict]] = {}
    done = {}

    def send(name: str, body: dict) -> None:
        answers[name] = post(server, body)
        done[name] = time.monotonic()

    bigs = [threading.Thread(target=send, args=(name, {**BIG, "seed": i}))
            for i, name in enumerate(("first", "second"))]
    bigs[0].start()
    deadline = time.monotonic() + 60
    while in_flight(server) < LIMIT // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    # 64 sequences charged half the limit, not 1 (an answer already in means it was not)
    assert in_flight(server) == LIMIT // 2, (answers, situation(server))
    # another client's 2-token request: room is left, it is served while the big one runs
    status, _, small = post(server, SMALL)
    assert status == 200 and small["usage"]["completion_tokens"] == 2
    assert "first" not in answers, "the small request waited for the big one to end"
    bigs[1].start()
    while in_flight(server) < 2 * (LIMIT // 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" not in answers and "second" not in answers
    # a third big one: admitted (a slot is left) but its sequences do not fit
    status, headers, error = post(server, {**BIG, "n": 2})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert error["error"]["code"] == "server_overloaded", error
    assert "16 sequences (prompts x n)" in error["error"]["message"]
    assert "past --max-pending-requests 5" in error["error"]["message"]
    # the small one still fits beside the two big ones
    status, _, small = post(server, SMALL)
    assert status == 200 and "first" not in answers and "second" not in answers
    for thread in bigs:
        thread.join(timeout=240)
    assert [answers[n][0] for n in ("first", "second")] == [200, 200]
    assert len(answers["first"][2]["choices"]) == 64
    assert in_flight(server) == 0
