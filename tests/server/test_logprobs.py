"""Log-probabilities and the default max_tokens, end to end: `aphrodite serve` with the tiny
Qwen2.5-VL and a small --max-model-len, driven by the official `openai` client. The numbers
are checked against an oracle that shares no code with the engine: the model's own forward
pass over prompt + generated tokens (log_softmax of the logits at each position)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.engine_fixtures import hf_prompt_ids, loaded

MAX_MODEL_LEN = 64
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve("--max-model-len", str(MAX_MODEL_LEN))]
MODEL = "tiny-qwen2_5_vl"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark, tests/served.py)."""
    return served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def oracle(prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each generated token's position, from one forward
    pass over the prompt and the generated tokens: row i is the distribution token i was
    drawn from."""
    model = loaded("qwen2_5_vl").model()
    ids = torch.tensor([prompt_ids + generated])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start:start + len(generated)], dim=-1)


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_chat_logprobs_are_the_models_own(client):
    """A greedy chat request's logprobs and top_logprobs equal the oracle's, token by token;
    the tokens are the generated ones (greedy: each is the most likely); written as strings
    they are the tokenizer's decoding of each id, with their UTF-8 bytes."""
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = reply.choices[0].logprobs.content
    prompt_ids = hf_prompt_ids("qwen2_5_vl", MESSAGES)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert len(content) == reply.usage.completion_tokens == 6
    generated = ids_of([e.token for e in content])
    want = oracle(prompt_ids, generated)
    got = torch.tensor([e.logprob for e in content])
    torch.testing.assert_close(got, want[torch.arange(6), torch.tensor(generated)],
                               rtol=1e-4, atol=1e-4)
    top_values, top_ids = torch.topk(want, 5, dim=-1)
    for i, entry in enumerate(content):
        assert len(entry.top_logprobs) == 5
        reported = ids_of([t.token for t in entry.top_logprobs])
        torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]),
                                   top_values[i], rtol=1e-4, atol=1e-4)
        # the reported ids carry the oracle's values (robust to ties in the ranking)
        torch.testing.assert_close(want[i, reported], top_values[i], rtol=1e-4, atol=1e-4)
        assert generated[i] == reported[0] or want[i, generated[i]] == top_values[i, 0]
    assert set(top_ids[0].tolist()) <= set(range(len(loaded("qwen2_5_vl").tokenizer)))

    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True})
    tokenizer = loaded("qwen2_5_vl").tokenizer
    for entry, token_id, before in zip(plain.choices[0].logprobs.content, generated, content,
                                       strict=True):
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(before.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [t.logprob for t in before.top_logprobs[:2]], abs=1e-5)
    # logprobs without top_logprobs: the token's own only
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          temperature=0, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], []]
    # not asked: null, as before
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2
                                          ).choices[0].logprobs is None


def test_chat_logprobs_stream_one_entry_per_token_chunk(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = []
    for c in chunks:
        if c.choices[0].logprobs is not None:
            assert len(c.choices[0].logprobs.content) == 1
            streamed += c.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_logprobs_shape_and_numbers(client):
    """``logprobs`` k on /v1/completions: tokens, token_logprobs, top_logprobs (the token
    and the k most likely) and text_offset; a prompt of token ids is the oracle's prompt."""
    tokenizer = loaded("qwen2_5_vl").tokenizer
    prompt_ids = tokenizer("Once upon a time")["input_ids"]
    reply = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=5, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = reply.choices[0].logprobs
    generated = ids_of(lp.tokens)
    want = oracle(prompt_ids, generated)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs),
                               want[torch.arange(5), torch.tensor(generated)],
                               rtol=1e-4, atol=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        assert lp.tokens[i] in top and 3 <= len(top) <= 4
        ids = ids_of(list(top))
        torch.testing.assert_close(torch.tensor(list(top.values())), want[i, ids],
                                   rtol=1e-4, atol=1e-4)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets

    plain = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                 logprobs=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**plain).choices[0].logprobs
    assert [list(t) for t in whole.top_logprobs] == [[t] for t in whole.tokens]
    assert whole.tokens == [tokenizer.decode([i]) for i in generated]
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for chunk in client.completions.create(**plain, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {key: getattr(whole, key) for key in streamed}


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 3}, "top_logprobs")])
def test_logprobs_out_of_range_is_a_400_naming_the_parameter(client, path, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        if path == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                           extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def test_chat_without_max_tokens_generates_up_to_the_model_length(client):
    """No max_tokens/max_completion_tokens: up to --max-model-len minus the prompt (OpenAI's
    and vLLM's rule); text completions keep their default of 16."""
    prompt = len(hf_prompt_ids("qwen2_5_vl", MESSAGES))
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == prompt
    assert reply.usage.completion_tokens == MAX_MODEL_LEN - prompt
    assert reply.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    assert [c.usage for c in stream if c.usage][-1].completion_tokens == MAX_MODEL_LEN - prompt
    text = client.completions.create(model=MODEL, prompt="Once", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 16
    # a prompt that fills the model length leaves no room: a 400, as with max_tokens too big
    long = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    for extra in ({}, {"max_tokens": 1}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=long, **extra)
        assert info.value.body["code"] == "context_length_exceeded"
        assert info.value.body["param"] == "messages"


def test_offline_llm_logprobs_are_vllms_shape_and_raw():
    """``SamplingParams(logprobs=k)`` in the offline LLM: per generated token a dict from id to
    Logprob(logprob, rank, decoded_token), the generated token first, then the k most likely.
    Sampled at temperature 2 with top-k 3, the numbers are still the raw distribution's (the
    oracle's log_softmax of the logits), as vLLM's default ``raw_logprobs`` reports."""
    from engine import SamplingParams
    from tests.engine_fixtures import llm

    tokenizer = loaded("qwen2_5_vl").tokenizer
    for params in (SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
                   SamplingParams(max_tokens=4, temperature=2.0, top_k=3, seed=7, logprobs=2,
                                  ignore_eos=True)):
        out = llm("qwen2_5_vl").generate("Once upon a time", params)[0]
        result = out.outputs[0]
        assert len(result.logprobs) == len(result.token_ids) == 4
        want = oracle(out.prompt_token_ids, result.token_ids)
        for i, (token, entry) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            assert next(iter(entry)) == token  # the generated token first
            assert len(entry) in (params.logprobs, params.logprobs + 1)
            ids = list(entry)
            torch.testing.assert_close(torch.tensor([entry[t].logprob for t in ids]),
                                       want[i, ids], rtol=1e-4, atol=1e-4)
            value = want[i, token]  # its rank, up to ties within the tolerance
            assert int((want[i] > value + 1e-4).sum()) + 1 <= entry[token].rank <= \
                int((want[i] >= value - 1e-4).sum())
            assert all(entry[t].decoded_token == tokenizer.decode([t]) for t in ids)
        assert result.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(result.token_ids, result.logprobs, strict=True)))
    # not asked: none
    assert llm("qwen2_5_vl").generate("Hi", SamplingParams(max_tokens=1))[0].outputs[0] \
        .logprobs is None
