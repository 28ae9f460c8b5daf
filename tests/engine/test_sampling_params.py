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
    # EOS forced, but not before min_tokens: exactly 6 tokens, then it ends on EOS
    assert len(outs[3].token_ids) == 6 and outs[3].finish_reason == "stop"
    assert plain.token_ids[0] not in outs[4].token_ids
    assert plain.text[:2] not in outs[4].text


def test_stop_token_ids_end_the_row_at_that_token(model):
    varied = model.generate(PROMPT, greedy(presence_penalty=2))[0].outputs[0].token_ids
    out = model.generate(PROMPT, greedy(presence_penalty=2, stop_token_ids=[varied[3]])
                         )[0].outputs[0]
    assert out.token_ids == varied[:3] and out.finish_reason == "stop"
    late = model.generate(PROMPT, greedy(presence_penalty=2, stop_token_ids=[varied[0]],
                                         min_tokens=2))[0].outputs[0]
    # banned until min_tokens (the greedy choice was that token: another comes first)
    assert late.token_ids[0] != varied[0] and len(late.token_ids) >= 2


def test_stop_strings_include_stop_str_and_min_tokens(model, plain):
    stop = plain.text[1:3]  # the tiny model's text repeats: this comes early and again
    cut = model.generate(PROMPT, greedy(stop=[stop]))[0].outputs[0].text
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
    got = logits_processors.apply(rows, logits, None, [0])
    # HF takes a rectangle of ids (a repeated id counts once, so row 2 is padded with 9s)
    ids = torch.tensor([[1, 2, 3, 3, 7, 7], [4, 5, 9, 9, 9, 9]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    assert torch.allclose(got, want)
    assert not torch.equal(got, logits)  # the raw logits (logprobs') are left alone
    rows = _rows(prompts, outs, presence_penalty=0.5, frequency_penalty=-0.25)
    got = logits_processors.apply(rows, logits, None, [0])
    want = logits.clone()
    want[0, 3] -= 0.5 - 0.25
    want[0, 7] -= 0.5 - 0.5
    want[1, 9] -= 0.5 - 0.25
    assert torch.allclose(got, want)
    rows[0].token_ids.append(3)  # counts follow the accepted tokens step by step
    got = logits_processors.apply(rows, logits, None, [0])
    assert torch.isclose(got[0, 3], logits[0, 3] - 0.5 + 0.5)


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
