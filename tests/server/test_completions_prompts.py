"""`/v1/completions` with ``prompt`` as a list: of strings, of token ids, of lists of token
ids; one choice per prompt and sample, numbered as OpenAI numbers them (``prompt_index * n +
sample``), each the same text the prompt gets alone (greedy), usage summed; ids outside the
vocabulary are a 400 naming ``prompt``."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import openai
import pytest

from tests.engine_fixtures import loaded

#: the default server, shared with the other modules that ask for it (tests/served.py)
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve()]
MODEL = "tiny-qwen2_5_vl"
PROMPTS = ["Once upon a time", "The quick brown fox", "Hello"]


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark, tests/served.py)."""
    return served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def complete(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                     max_tokens=kwargs.pop("max_tokens", 4),
                                     extra_body={"ignore_eos": True}, **kwargs)


@pytest.fixture(scope="module")
def alone(served):
    """Each prompt's greedy text and prompt tokens when sent alone."""
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    return {p: complete(client, p) for p in PROMPTS}


def test_a_list_of_strings_is_one_choice_per_prompt_and_sample(client, alone):
    reply = complete(client, PROMPTS, n=2)
    assert [c.index for c in reply.choices] == list(range(6))
    for c in reply.choices:
        assert c.text == alone[PROMPTS[c.index // 2]].choices[0].text
        assert c.finish_reason == "length"
    assert reply.usage.prompt_tokens == sum(alone[p].usage.prompt_tokens for p in PROMPTS)
    assert reply.usage.completion_tokens == 6 * 4


def test_token_id_prompts_are_the_tokenized_text(client, alone):
    tokenizer = loaded("qwen2_5_vl").tokenizer
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    one = complete(client, ids[0])
    assert one.usage.prompt_tokens == len(ids[0]) == alone[PROMPTS[0]].usage.prompt_tokens
    assert one.choices[0].text == alone[PROMPTS[0]].choices[0].text
    many = complete(client, ids)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [alone[p].choices[0].text for p in PROMPTS]
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_streamed_list_prompts_carry_each_choice_by_index(client, alone):
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in complete(client, PROMPTS, n=2, stream=True,
                          stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {i: alone[PROMPTS[i // 2]].choices[0].text for i in range(6)}
    assert reasons == dict.fromkeys(range(6), "length")
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens == sum(alone[p].usage.prompt_tokens for p in PROMPTS)


@pytest.mark.parametrize(("prompt", "code"), [
    ([1, 2, 10**6], "invalid_token_id"), ([[1, 2], [3, -1]], "invalid_token_id"),
    ([], "invalid_request"), ([[]], "invalid_request"), ([1, "a"], "invalid_request"),
    ([True], "invalid_request"), ({"text": "x"}, "invalid_request"), ("", "invalid_request"),
    (["x"] * 65, "too_many_prompts")])
def test_bad_prompts_are_a_400_naming_prompt(server, prompt, code):
    req = urllib.request.Request(f"{server.base}/v1/completions", data=json.dumps(
        {"prompt": prompt, "max_tokens": 1}).encode(), headers={"Content-Type":
                                                                  "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    body = json.loads(info.value.read())
    assert info.value.code == 400
    assert (body["error"]["param"], body["error"]["code"]) == ("prompt", code)


def test_a_media_placeholder_id_is_refused(client):
    pad = loaded("qwen2_5_vl").tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, [1, pad])
    assert info.value.body["param"] == "prompt"


def engine_numbers(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"{server.base}/metrics").read().decode()
    numbers = {k: float(v) for k, v in re.findall(r"^aphrodite_engine_(\w+) (\S+)$", text, re.M)}
    closed = re.search(r'^aphrodite_requests_total\{route="/v1/completions",status="499"\} '
                       r"(\S+)$", text, re.M)
    numbers["closed"] = float(closed.group(1)) if closed else 0.0
    return numbers


def wait_for(server, check, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        numbers = engine_numbers(server)
        if check(numbers) or time.monotonic() > deadline:
            return numbers
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_stops_every_prompts_generation(server, stream):
    """Several prompts of 4000 tokens each; the client closes the connection once they run:
    every engine request ends at once (streamed or not), counted as a 499."""
    before = engine_numbers(server)["closed"]
    body = json.dumps({"prompt": ["a", "b"], "max_tokens": 4000, "ignore_eos": True,
                       "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                 b"json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    running = wait_for(server, lambda n: n["requests_in_flight"] == 2)
    assert running["requests_in_flight"] == 2
    sock.close()
    after = wait_for(server, lambda n: n["requests_in_flight"] == 0, timeout=10)
    assert after["requests_in_flight"] == 0 and after["num_rows_running"] == 0
    assert wait_for(server, lambda n: n["closed"] == before + 1, 30)["closed"] == before + 1
    assert "Traceback" not in server.output and "Error handling request" not in server.output


def test_a_priority_under_fcfs_scheduling_is_refused_naming_the_flag(client):
    """vLLM refuses a request priority its scheduler would ignore; so does this server, and
    says which flag honours it. Priority 0 (the default) is accepted."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                  extra_body={"priority": 2})
    error = info.value.body
    assert error["param"] == "priority" and error["code"] == "unsupported_parameter"
    assert "--scheduling-policy priority" in error["message"], error
    # ignore_eos: a random-weight model may sample its EOS first, and the tokens show it ran
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                    extra_body={"priority": 0, "ignore_eos": True})
    assert out.usage.completion_tokens == 2
