"""Output text as tokens arrive: the incremental deltas join to one decode of every token, on
every family's tokenizer; a stream never sends text a stop string takes back, and text held
back for a stop string still forming goes out when the row ends another way."""

from __future__ import annotations

import random

import pytest

from engine.executor.detokenize import Detokenizer, byte_tokens
from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from tests.engine_fixtures import FAMILIES, llm, loaded

TEXT = "Héllo wörld, 中文字 and 😀👍🏽 ok!\n  spaces  and\ttabs"


@pytest.mark.parametrize("arch", FAMILIES)
def test_deltas_join_to_one_decode_of_all_tokens(arch):
    tok = loaded(arch).tokenizer
    rng = random.Random(arch)
    words = tok(TEXT, add_special_tokens=False)["input_ids"]
    specials = list(tok.all_special_ids)
    byte_ids = byte_tokens(tok)
    for case in range(200):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 40):
            pick = rng.random()
            if pick < 0.4:  # a run of real text (multi-byte characters split across tokens)
                start = rng.randrange(len(words))
                ids += words[start:start + rng.randint(1, 8)]
            elif pick < 0.5:
                ids.append(rng.choice(specials))
            else:
                ids.append(rng.randrange(len(tok)))
        detok = Detokenizer(tok, byte_ids)
        deltas = [detok.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == detok.text == full, (case, ids)
        if "\ufffd" not in full:  # a split character is held until whole, never sent broken
            assert not any("\ufffd" in d for d in deltas)


def stream(model, prompt, params: SamplingParams) -> tuple[list[str], object]:
    events: list[str] = []
    req = model.engine.submit(EngineRequest(prompt, params,
                                            on_event=lambda e: events.append(e.text_delta)))
    assert req.done.wait(120) and req.error is None, req.error
    return events, req.outputs[0]


def test_a_stream_never_sends_text_a_stop_string_takes_back():
    """A stop string spanning several tokens: the deltas sent join to exactly the text before
    it (the characters it could still take back were held, not sent and then cut)."""
    model = llm("qwen2_vl")
    prompt = model.prepare("Tell me a story.", [], None, raw=True)[1]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    _, free = stream(model, prompt, sampled)
    text = free.text
    assert len(set(text)) > 3, text  # varied text: the stop string below is not at its start
    stop = text[10:14]
    expected = text[:text.find(stop)]
    deltas, out = stream(model, prompt, SamplingParams(
        max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert "".join(deltas) == out.text == expected
    # a stop string that never comes: the held-back tail goes out when the row ends
    deltas, out = stream(model, prompt, SamplingParams(
        max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, stop=["\x00never here"]))
    assert out.finish_reason == "length" and "".join(deltas) == out.text == text
