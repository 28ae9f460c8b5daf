"""What a quantization costs in quality, against the same model's float weights, on a fixed
prompt set (``bench decode-step --quantization``):

- the reference: each prompt's greedy continuation of ``tokens`` tokens from the float model
  (through the engine), and the float model's next-token distribution at each of those
  positions (one forward pass over prompt + continuation);
- ``top1_agreement``: the share of those positions where the quantized model, given the same
  tokens before (teacher-forced), picks the same next token as the float one;
- ``mean_kl``: the mean over those positions of KL(float || quantized) of the next-token
  distributions, in nats;
- ``greedy_match``: the share of the quantized model's own greedy continuation (through the
  engine: its decode step) equal to the float one token for token, position by position;
  ``identical_prompts`` how many continuations are equal throughout.
"""

from __future__ import annotations

from typing import Any

#: the fixed prompt set: plain text of different kinds, so no media enter the comparison
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Describe the picture: a red bicycle leaning against a stone wall at sunset,",
    "Translate to German: The weather is nice today and we are going for a walk.",
    "1, 2, 3, 5, 8, 13, 21,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    '{"name": "Alice", "age": 30, "languages": ["English",',
)


def _greedy(llm: Any, tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(list(PROMPTS), params)]


def _log_probs(llm: Any, continuations: list[list[int]]) -> list[Any]:
    """Per prompt, the model's next-token log-probabilities at each continuation position
    (teacher-forced: the float model's continuation as the tokens before)."""
    import torch

    model = llm.engine.runner.model
    tokenizer = llm.loaded.tokenizer
    out = []
    with torch.inference_mode():
        for prompt, tail in zip(PROMPTS, continuations, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + tail
            logits = model(input_ids=torch.tensor([ids])).logits[0, -len(tail) - 1:-1]
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


def reference(llm: Any, tokens: int) -> dict[str, Any]:
    """The float model's continuations and distributions (see the module's text)."""
    continuations = _greedy(llm, tokens)
    return {"continuations": continuations, "log_probs": _log_probs(llm, continuations)}


def compare(llm: Any, ref: dict[str, Any]) -> dict[str, Any]:
    """The quantized ``llm`` against the float ``ref`` (see the module's text)."""
    import torch

    continuations = ref["continuations"]
    positions = agree = 0
    kl_sum = 0.0
    for want, p_log, q_log in zip(continuations, ref["log_probs"],
                                  _log_probs(llm, continuations), strict=True):
        kl_sum += float((p_log.exp() * (p_log - q_log)).sum())
        agree += int((q_log.argmax(-1) == torch.tensor(want)).sum())
        positions += len(want)
    own = _greedy(llm, len(continuations[0]))
    same = sum(a == b for mine, theirs in zip(own, continuations, strict=True)
               for a, b in zip(mine, theirs, strict=True))
    return {"prompts": len(PROMPTS), "tokens_per_prompt": len(continuations[0]),
            "positions": positions, "top1_agreement": agree / positions,
            "mean_kl": kl_sum / positions, "greedy_match": same / positions,
            "identical_prompts": sum(a == b for a, b in zip(own, continuations, strict=True))}
