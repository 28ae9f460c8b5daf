"""The sampling parameters vLLM users send (penalties, logit_bias, min_p, min_tokens,
stop_token_ids, bad_words, skip_special_tokens, include_stop_str_in_output): what each does
to the sampled tokens, on the tiny random-weight model through the offline LLM, with rows
with and without them in one batch; the penalties against Hugging Face's processors on the
same logits; the ranges as 400s naming the field (model-free)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.executor import logits_processors
from engine.server.api.protocol import parse_generation_fields
from tests.engine_fixtures import llm

pytestmark = pytest.mark.timeout(300)
PROMPT = "Hello there"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def model():
    return llm("qwen2_5_vl")


@pytest.fixture(scope="module")
def plain(model):
    """The greedy answer with no processor (the tiny model repeats one token)."""
    return model.generate(PROMPT, greedy())[0].outputs[0]


def run_batch(model, params: list[SamplingParams]) -> list:
    """Each params on the same prompt, all submitted together: one running batch."""
    return [r.outputs[0] for r in model.generate([PROMPT] * len(params), params)]


def test_each_parameter_changes_only_its_own_row_in_a_shared_batch(model, plain):
    eos = next(iter(model.engine.runner.eos_ids))
    outs = run_batch(model, [
        greedy(),
        SamplingParams(max_tokens=8, temperature=1, seed=3, logit_bias={"77": 100}),
        greedy(presence_penalty=2),
        greedy(max_tokens=10, min_tokens=6, logit_bias={eos: 100}),
        greedy(bad_words=[plain.text[:2]]),
    ])
    assert outs[0].token_ids == plain.token_ids  # the row without any: untouched
    assert outs[1].token_ids == [77] * 8  # +100 forces the token at temperature 1
    assert len(set(outs[2].token_ids)) == len(outs[2].token_ids)  # never repeats a token
    # EOS forced, but not before min_tokens: 6 tokens, then it ends on EOS (the 7th, counted
    # as vLLM counts it)
    assert len(outs[3].token_ids) == 7 and outs[3].finish_reason == "stop"
    assert outs[3].token_ids[-1] == eos and eos not in outs[3].token_ids[:6]
    assert plain.token_ids[0] not in outs[4].token_ids
    assert plain.text[:2] not in outs[4].text


def test_stop_token_ids_end_the_row_at_that_token(model):
    varied = model.generate(PROMPT, greedy(presence_penalty=2))[0].outputs[0].token_ids
    out = model.generate(PROMPT, greedy(presence_penalty=2, stop_token_ids=[varied[3]])
                         )[0].outputs[0]
    # the stop token is the output's last (vLLM's count), its text left out
    assert out.token_ids == varied[:4] and out.finish_reason == "stop"
    assert out.stop_reason == varied[3]  # vLLM's: the stop token that ended it
    decode = model.engine.runner.tokenizer.decode
    assert out.text == decode(varied[:3], skip_special_tokens=True)
    kept = model.generate(PROMPT, greedy(presence_penalty=2, stop_token_ids=[varied[3]],
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == varied[:4] and \
        kept.text == decode(varied[:4], skip_special_tokens=True)
    late = model.generate(PROMPT, greedy(presence_penalty=2, stop_token_ids=[varied[0]],
                                         min_tokens=2))[0].outputs[0]
    # banned until min_tokens (the greedy choice was that token: another comes first)
    assert late.token_ids[0] != varied[0] and len(late.token_ids) >= 2


def test_stop_strings_include_stop_str_and_min_tokens(model, plain):
    stop = plain.text[1:3]  # the tiny model's text repeats: this comes early and again
    ended = model.generate(PROMPT, greedy(stop=[stop]))[0].outputs[0]
    cut = ended.text
    assert ended.stop_reason == stop and plain.stop_reason is None
    kept = model.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=True)
                          )[0].outputs[0].text
    assert cut == plain.text[:1] and kept == plain.text[:3]
    later = model.generate(PROMPT, greedy(stop=[stop], min_tokens=4))[0].outputs[0]
    assert len(later.token_ids) >= 4 and later.finish_reason == "stop"


def test_skip_special_tokens_false_keeps_them_in_the_text(model):
    tok = model.loaded.tokenizer
    special = next(t for t in tok.all_special_ids if t not in model.engine.runner.eos_ids)
    force = {"logit_bias": {special: 100}, "max_tokens": 2}
    assert model.generate(PROMPT, greedy(**force))[0].outputs[0].text == ""
    text = model.generate(PROMPT, greedy(**force, skip_special_tokens=False))[0].outputs[0].text
    assert text == tok.convert_ids_to_tokens(special) * 2


def test_min_p_one_samples_the_most_likely_token(model, plain):
    out = model.generate(PROMPT, SamplingParams(max_tokens=12, temperature=2, seed=5,
                                                min_p=1.0))[0].outputs[0]
    assert out.token_ids == plain.token_ids


def _rows(prompts, outputs, **kw):
    return [SimpleNamespace(done=False, logits_state=None, token_ids=list(out),
                            request=SimpleNamespace(params=SamplingParams(**kw),
                                                    prompt=SimpleNamespace(input_ids=p)))
            for p, out in zip(prompts, outputs, strict=True)]


def test_penalties_match_hugging_face_and_openai_formulas():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 3
    prompts, outs = [[1, 2, 3], [4, 5]], [[3, 7, 7], [9]]
    rows = _rows(prompts, outs, repetition_penalty=1.7)
    got = logits_processors.apply(rows, logits.clone(), None, [0])
    # HF takes a rectangle of ids (a repeated id counts once, so row 2 is padded with 9s)
    ids = torch.tensor([[1, 2, 3, 3, 7, 7], [4, 5, 9, 9, 9, 9]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    assert torch.allclose(got, want)
    rows = _rows(prompts, outs, presence_penalty=0.5, frequency_penalty=-0.25)
    got = logits_processors.apply(rows, logits.clone(), None, [0])
    want = logits.clone()
    want[0, 3] -= 0.5 - 0.25
    want[0, 7] -= 0.5 - 0.5
    want[1, 9] -= 0.5 - 0.25
    assert torch.allclose(got, want)
    rows[0].token_ids.append(3)  # counts follow the accepted tokens step by step
    got = logits_processors.apply(rows, logits.clone(), None, [0])
    assert torch.isclose(got[0, 3], logits[0, 3] - 0.5 + 0.5)


def test_a_row_asking_for_logprobs_keeps_the_raw_logits():
    """vLLM's raw_logprobs: the logits the logprobs are taken from are the model's, so the
    processors work on a copy when a live row asks for them (else in place)."""
    import torch

    logits = torch.randn(2, 50)
    raw = logits.clone()
    rows = _rows([[1], [2]], [[3], [4]], presence_penalty=1.0)
    rows[1].request.params = SamplingParams(presence_penalty=1.0, logprobs=2)
    got = logits_processors.apply(rows, logits, None, [0])
    assert torch.equal(logits, raw) and got is not logits
    assert got[0, 3] == raw[0, 3] - 1 and got[1, 4] == raw[1, 4] - 1


def _dense_penalties(logits, prompts, outputs, params):
    """vLLM's ``apply_penalties`` as it is written: (rows, vocabulary) bin counts of the
    output and masks of the prompt, rebuilt from each row's whole history."""
    import torch

    n, vocab = logits.shape
    counts = torch.zeros(n, vocab)
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        counts[i].index_add_(0, torch.tensor(out, dtype=torch.long), torch.ones(len(out)))
        prompt_mask[i, prompt] = True

    def column(name):
        return torch.tensor([getattr(p, name) for p in params]).view(n, 1)

    rep = torch.where(prompt_mask | (counts > 0), column("repetition_penalty"), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= column("frequency_penalty") * counts
    logits -= column("presence_penalty") * (counts > 0).to(logits.dtype)
    return logits


def test_the_incremental_sparse_penalties_equal_vllm_dense_ones_step_by_step():
    """Rows with and without penalties (and finished ones) over many steps, each step's
    logits fresh, the state growing past its first capacity: every step equals the dense
    formulas rebuilt from the whole history, to the bit."""
    import random

    import torch

    rng = random.Random(7)
    vocab = 3000
    kinds = [dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
             dict(),
             dict(presence_penalty=-1.5),
             dict(repetition_penalty=0.7, frequency_penalty=2.0),
             dict(repetition_penalty=1.1, logit_bias={"5": 3})]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 300))] for _ in kinds]
    rows = [SimpleNamespace(done=False, logits_state=None, token_ids=[],
                            request=SimpleNamespace(params=SamplingParams(**kw),
                                                    prompt=SimpleNamespace(input_ids=p)))
            for kw, p in zip(kinds, prompts, strict=True)]
    params = [r.request.params for r in rows]
    gen = torch.Generator().manual_seed(1)
    for step in range(150):
        rows[3].done = step >= 100  # a finished row is skipped, its state kept
        logits = torch.randn(len(rows), vocab, generator=gen) * 4
        logits[0, :40] = float("-inf")  # (a grammar's mask before the processors)
        want = logits.clone()
        want[4, 5] += 3
        want = _dense_penalties(want, prompts, [r.token_ids for r in rows], params)
        want[3] = logits[3] if rows[3].done else want[3]
        want[1] = logits[1]
        got = logits_processors.apply(rows, logits, None, [0])
        assert torch.equal(got, want), step
        for r in rows:
            if not r.done:  # a small alphabet: tokens repeat and new ones keep coming
                r.token_ids += [rng.randrange(step + 2) * 11 % vocab
                                for _ in range(1 if step % 7 else 3)]
    assert rows[0].logits_state.size > 64  # it grew past its first capacity
    assert rows[1].logits_state is None  # a row without processors has no state


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("presence_penalty", 2.5, "between -2 and 2"),
    ("frequency_penalty", -3, "between -2 and 2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("min_p", 1.5, "between 0 and 1"),
    ("min_tokens", 17, "from 0 to max_tokens (16)"),
    ("logit_bias", {"5": 101}, "from -100 to 100"),
    ("logit_bias", {"five": 1}, "token ids"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "up to 300"),
    ("logit_bias", {"449": 1}, "out of the vocabulary (0 to 448)"),
    ("stop_token_ids", [1000], "out of the vocabulary"),
    ("stop_token_ids", ["1"], "token ids"),
    ("bad_words", [""], "non-empty strings"),
    ("bad_words", "word", "must be list"),
    ("skip_special_tokens", "false", "must be bool"),
    ("include_stop_str_in_output", 1, "must be bool"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_out_of_range_values_are_a_400_naming_the_field(field, value, rule, chat):
    body = {"max_tokens": 16, field: value}
    with pytest.raises(InvalidRequestError) as err:
        parse_generation_fields(body, max_tokens_cap=4096, chat=chat, vocab_size=449)
    assert err.value.param == field and rule in str(err.value)
    assert err.value.status == 400


def test_the_offline_api_checks_token_ids_against_the_vocabulary(model):
    with pytest.raises(InvalidRequestError, match="logit_bias holds token id 100000"):
        model.generate(PROMPT, greedy(logit_bias={100000: 5}))


def test_the_offline_api_takes_the_generation_config_defaults(model, plain, tmp_path):
    """vLLM's ``LLM(generation_config=...)``: a call without sampling parameters gets the
    folder's values (here greedy and 5 tokens); "vllm" none."""
    import json

    from engine import LLM

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0, "max_new_tokens": 5, "repetition_penalty": 1.0}))
    assert model.get_default_sampling_params() == SamplingParams()  # tiny's file sets none
    offline = LLM("tiny:qwen2_5_vl", generation_config=str(tmp_path))
    try:
        defaults = offline.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
        assert offline.generate(PROMPT)[0].outputs[0].token_ids == plain.token_ids[:5]
    finally:
        offline.close()


@pytest.mark.parametrize("seeded", [False, True])
def test_a_draw_follows_the_distribution_and_never_takes_a_token_without_mass(seeded):
    """The sampler's draw through the cumulative distribution (the row's own generator, or
    torch's global stream unseeded: torch.manual_seed makes it repeat)."""
    import torch

    from engine.executor import sampler

    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])

    def draws():
        torch.manual_seed(11)
        generator = sampler.seeded_generator(5) if seeded else None
        return [sampler._draw(probs, generator) for _ in range(4000)]

    got = draws()
    assert set(got) == {1, 3} and 0.22 < got.count(1) / len(got) < 0.28
    assert draws() == got


def _top_p_by_full_sort(probs, top_p):
    import torch

    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
    keep[0] = True
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[keep]] = True
    return torch.where(mask, probs, torch.zeros_like(probs))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (the head grows to all) to peaked
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_from_the_head_equals_the_full_sort(scale, top_p):
    import torch

    from engine.executor import sampler

    gen = torch.Generator().manual_seed(int(scale * 100 + top_p * 1000))
    for _ in range(5):
        probs = torch.softmax(torch.randn(50000, generator=gen) * scale, dim=-1)
        probs[probs < 1e-7] = 0.0  # (as min_p leaves them: mass taken out)
        assert torch.equal(sampler.top_p_filter(probs, top_p),
                           _top_p_by_full_sort(probs, top_p))
