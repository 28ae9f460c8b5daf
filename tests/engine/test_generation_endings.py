"""What no other test produces: a generation that ends on EOS (the held stop-string text goes
out with the end), top-k/top-p that provably constrain every sampled token, and a batch of
three rows whose middle row leaves first while the others keep their exact logits."""

from __future__ import annotations

import pytest

from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from tests.engine.test_scheduler import hf_logits, media_item, record_logits
from tests.engine_fixtures import llm

ARCH = "qwen2_5_vl"


def image_prompt(seed: int, text: str = "What is it?"):
    model = llm(ARCH)
    placeholder = model.loaded.spec.placeholders["image"]
    return model.prepare(placeholder + text, [media_item("image", seed)], None, False)[1]


def run(prompt, params: SamplingParams) -> tuple[EngineRequest, list[str]]:
    """Submit one request to the shared tiny model's engine; its output and streamed text."""
    deltas: list[str] = []
    req = llm(ARCH).engine.submit(EngineRequest(prompt, params,
                                                on_event=lambda e: deltas.append(e.text_delta)))
    assert req.done.wait(120) and req.error is None, req.error
    return req, deltas


def sampled(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True, **kw)


def test_a_generation_stops_at_eos_and_flushes_text_a_stop_string_held_back():
    """The seeded draws are the same with and without EOS, so with a token of the first run
    made the EOS the second run ends at it (finish_reason "stop"; the EOS is the last of the
    output's tokens, as vLLM counts it, and adds no text). With a stop string that the
    text's last character begins, that character is held back while the string could still
    complete; the EOS ends the row and the held text still goes out: the streamed deltas
    add up to the whole text."""
    runner = llm(ARCH).engine.runner
    prompt = image_prompt(3)
    first, _ = run(prompt, sampled())
    tokens = first.outputs[0].token_ids
    assert len(tokens) == 16
    cut = next(k for k in range(4, 16) if tokens[k] not in tokens[:k])
    saved = set(runner.eos_ids)
    runner.eos_ids = {tokens[cut]}
    try:
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
        ended, deltas = run(prompt, params)
        out = ended.outputs[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == tokens[:cut + 1]
        text = out.text
        # the EOS adds no text (the tokens before it: all of theirs but a character whose
        # bytes had not all come)
        full = llm(ARCH).engine.runner.tokenizer.decode(tokens[:cut], skip_special_tokens=True)
        assert full.startswith(text) and len(full) - len(text) <= 1
        assert text and "".join(deltas) == text
        stop = text[-1] + "\u0001never"
        held, held_deltas = run(prompt, SamplingParams(max_tokens=16, temperature=1.0,
                                                       seed=1234, stop=[stop]))
        out = held.outputs[0]
        assert out.finish_reason == "stop" and out.token_ids == tokens[:cut + 1]
        # the last character was held (the stop string might have completed) until the end
        assert "".join(held_deltas[:-1]) != text
        assert "".join(held_deltas) == text
    finally:
        runner.eos_ids = saved


def record_row_logits(engine) -> dict:
    """Every step's logits per (request, row index), as the engine sampled from them (the
    rows of one request may run in different batches: max_num_seqs is 8 here)."""
    seen: dict = {}
    sample = engine.runner._sample

    def recording(rows, logits):
        for i, row in enumerate(rows):
            key = (row.request.request_id, row.index)
            seen.setdefault(key, []).append(logits[i].float().clone())
        return sample(rows, logits)

    engine.runner._sample = recording
    return seen


def _allowed_sets(logits, params: SamplingParams) -> set[int]:
    """The tokens top-k / top-p leave for one step's logits."""
    import torch

    scores = logits.float() / params.temperature
    order = torch.argsort(scores, descending=True)
    if params.top_k > 0:
        order = order[:params.top_k]
    probs = torch.softmax(scores, dim=-1)[order]
    probs = probs / probs.sum() if params.top_k > 0 else probs
    cumulative = torch.cumsum(probs, 0) - probs
    keep = order[cumulative < params.top_p]
    return set(keep.tolist())


@pytest.mark.parametrize("constraint", [{"top_k": 3}, {"top_p": 0.05}, {"top_k": 1}])
def test_top_k_and_top_p_constrain_every_sampled_token(constraint):
    """Every token sampled (16 rows x 12 steps at temperature 2, where the unconstrained
    distribution is nearly flat) lies in the set the rule allows for its step's logits; the
    same draws without the rule leave that set, so the check can fail."""
    engine = llm(ARCH).engine
    prompt = image_prompt(5)
    rule = SamplingParams(max_tokens=12, temperature=2.0, seed=7, n=16, ignore_eos=True,
                          **constraint)
    free = SamplingParams(max_tokens=12, temperature=2.0, seed=7, n=16, ignore_eos=True)
    original = engine.runner._sample
    outside = {}
    try:
        for name, params in (("rule", rule), ("free", free)):
            per_row = record_row_logits(engine)
            req, _ = run(prompt, params)
            misses = 0
            for out in req.outputs:
                row_logits = per_row[(req.request_id, out.index)]
                assert len(out.token_ids) == 12
                for token, step in zip(out.token_ids, row_logits, strict=True):
                    misses += token not in _allowed_sets(step, rule)
            outside[name] = misses
            engine.runner._sample = original
    finally:
        engine.runner._sample = original
    assert outside["rule"] == 0
    assert outside["free"] > 0
    if constraint == {"top_k": 1}:  # top-1 sampling is greedy
        greedy, _ = run(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        req, _ = run(prompt, rule)
        assert all(o.token_ids == greedy.outputs[0].token_ids for o in req.outputs)


def test_the_middle_row_of_three_leaves_and_the_others_keep_their_exact_logits():
    """Three rows run together; the middle one ends after 3 tokens and leaves the batch (its
    cache columns selected out); the first and last go on to 14 tokens and every step's
    logits equal the model's own generate on each prompt alone."""
    import torch

    engine = llm(ARCH).engine
    prompts = [image_prompt(11, "Describe it."),
               llm(ARCH).prepare("Just a short text prompt.", [], None, raw=True)[1],
               image_prompt(12, "A longer question about what this picture shows, please.")]
    lengths = [14, 3, 14]
    batch_sizes: list[int] = []
    decode = engine.runner.decode

    def counting(batch):
        batch_sizes.append(len(batch.rows))
        return decode(batch)

    engine.runner.decode = counting
    logits = record_logits(engine)
    original = engine.runner._sample
    try:
        reqs = [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts, lengths, strict=True)]
        for r in reqs:  # sent together: they share the prefill
            engine.submit(r)
        for r in reqs:
            assert r.done.wait(120) and r.error is None, r.error
    finally:
        engine.runner.decode = decode
        engine.runner._sample = original
    assert 3 in batch_sizes and batch_sizes[-1] == 2, batch_sizes  # the middle row left
    assert [len(r.outputs[0].token_ids) for r in reqs] == lengths
    for req, prompt, n in zip(reqs, prompts, lengths, strict=True):
        torch.testing.assert_close(logits["stack"](req), hf_logits(engine, prompt, n),
                                   atol=1e-4, rtol=1e-4)

