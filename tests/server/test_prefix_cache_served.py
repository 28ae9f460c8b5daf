"""Served: a second question about the same image reports the prompt tokens the prefix cache
supplied in ``usage.prompt_tokens_details.cached_tokens`` (streamed and not), and /metrics
counts them in vLLM's ``vllm:prefix_cache_queries``/``vllm:prefix_cache_hits`` and the
engine's own counters; ``--no-enable-prefix-caching`` turns it off with the same answers."""

from __future__ import annotations

import base64
import re
import urllib.request

import openai
import pytest

from tests.fixtures import synthetic
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(400)

MODEL = "tiny:qwen2_5_vl"
START = "Look closely at this picture and at every detail in it before you answer. " * 2


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"{name} not on /metrics"
    return float(found.group(1))


def ask(client: openai.OpenAI, image: str, question: str, stream: bool = False,
        salt: str | None = None):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": START + question}]}]
    extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
    common = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": messages,
              "extra_body": extra}
    if not stream:
        reply = client.chat.completions.create(**common)
        return reply.choices[0].message.content, reply.usage
    chunks = list(client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
        chunks[-1].usage


def test_cached_tokens_in_usage_and_prefix_cache_counters_on_metrics():
    image = "data:image/jpeg;base64," + base64.b64encode(
        synthetic.make_image(160, 120, fmt="JPEG", seed=5)).decode()
    answers = {}
    for flags in ((), ("--no-enable-prefix-caching",)):
        server = ServerProcess(MODEL, "--server-dev-mode", *flags).wait_ready()
        try:
            client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
            replies = [ask(client, image, "What is in it?"),
                       ask(client, image, "Which colours does it have?"),
                       ask(client, image, "Which colours does it have?", stream=True)]
            text = scrape(server)
            if not flags:
                cold = cold_after_resets(server, client, image, text)
                salted_apart(server, client, image)
        finally:
            assert server.stop() == 0
        answers[flags] = [content for content, _ in replies]
        cached = [usage.prompt_tokens_details.cached_tokens for _, usage in replies]
        prompts = [usage.prompt_tokens for _, usage in replies]
        queries = metric(text, "vllm:prefix_cache_queries_total")
        hits = metric(text, "vllm:prefix_cache_hits_total")
        usage = metric(text, "vllm:kv_cache_usage_perc")  # prefix cache held / its capacity
        if flags:
            assert cached == [0, 0, 0] and hits == 0 and usage != usage  # NaN: no such cache
            continue
        assert 0 < usage < 1
        assert usage == pytest.approx(metric(text, "aphrodite_engine_prefix_cache_bytes")
                                      / (0.5 * (1 << 30)))  # (--prefix-cache-gb 0.5)
        # the image and the text after it came from the cache, the last prompt all but its
        # last token (whole blocks of 16)
        assert cached[0] == 0 and 0 < cached[1] < prompts[1]
        assert cached[2] == (prompts[2] - 1) // 16 * 16
        assert queries == sum(prompts) and hits == sum(cached)
        assert metric(text, "aphrodite_engine_prefix_cache_hits") == hits
        assert metric(text, "aphrodite_engine_prefix_cache_queries") == queries
        assert metric(text, "aphrodite_engine_encoder_cache_misses") == 1
        assert metric(text, "aphrodite_engine_prefix_cache_bytes") > 0
    assert answers[()] == answers[("--no-enable-prefix-caching",)]
    assert cold == answers[()][1]  # the reset caches gave back the same answer


def scrape(server) -> str:
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as resp:
        return resp.read().decode()


def cold_after_resets(server, client, image: str, before: str) -> str:
    """After both reset routes the same question is truly cold: no prompt token from the
    prefix cache, the encoder runs again (its cache emptied too, which survived both
    resets before) and the processor cache misses."""
    def counts(text: str) -> tuple[float, ...]:
        return tuple(metric(text, name) for name in (
            "aphrodite_engine_encoder_cache_hits", "aphrodite_engine_encoder_cache_misses",
            'aphrodite_processor_cache_total{result="miss"}'))

    hits_before, misses_before, processor_misses = counts(before)
    assert misses_before == 1  # (later questions found the image in the prefix cache)
    for route in ("/reset_mm_cache", "/reset_prefix_cache"):
        request = urllib.request.Request(f"{server.base}{route}", method="POST")
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
    content, usage = ask(client, image, "Which colours does it have?")
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert counts(scrape(server)) == (hits_before, misses_before + 1, processor_misses + 1)
    return content


def salted_apart(server, client, image: str) -> None:
    """vLLM's cache_salt: a tenant's second request finds its own first in every cache; the
    same request under another salt (or none) finds nothing: no cached prompt token, and the
    processor and encoder caches miss, so neither usage nor timing tells one tenant what
    another sent. The answer does not change."""
    def misses() -> tuple[float, float]:
        text = scrape(server)
        return (metric(text, 'aphrodite_processor_cache_total{result="miss"}'),
                metric(text, "aphrodite_engine_encoder_cache_misses"))

    question = "Which colours does it have?"
    first = ask(client, image, question, salt="tenant-a")
    again = ask(client, image, question, salt="tenant-a")
    assert again[1].prompt_tokens_details.cached_tokens > 0 and again[0] == first[0]
    before = misses()
    other = ask(client, image, question, salt="tenant-b")
    assert other[1].prompt_tokens_details.cached_tokens == 0 and other[0] == first[0]
    assert misses() == (before[0] + 1, before[1] + 1)
    # the unsalted request of earlier is still cached for the unsalted, not for tenant-a
    assert ask(client, image, question)[1].prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, image, question, salt="")
    assert info.value.body["param"] == "cache_salt"
