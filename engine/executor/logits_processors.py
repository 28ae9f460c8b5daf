"""The logits processors a request's sampling parameters ask for, on the batch's logits.

In vLLM's order (its v1 sampler): ``bad_words``, ``min_tokens`` (the row's end tokens banned
until it has that many), ``logit_bias``, then the penalties: ``repetition_penalty`` (vLLM's
and Hugging Face's rule, over the prompt's and the generated tokens: a positive logit divided
by it, a negative one multiplied), ``frequency_penalty`` (times each token's count in the
generated text) and ``presence_penalty`` (once per token that appeared in it: OpenAI's rule).
Temperature, ``min_p``, top-k and top-p come after, in the sampler.

Each row keeps its state (:class:`RowLogits`): the generated tokens' counts as one vocabulary
tensor, brought up to date with the tokens accepted since its last step (one scatter per
step, not a count over the whole output), and a mask of the prompt's tokens. The penalties of
all the rows that have them are one batched operation over a stacked (rows, vocabulary)
tensor; rows without any processor cost nothing. The logits a row's log-probabilities report
are those before these processors (vLLM's default ``raw_logprobs``): :func:`apply` works on a
copy.

The stop decision this module holds (:func:`stops_on_token`) is a pure function of the
parameters, the token and the row's output length, so the scheduler's stop check can call it
as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


def stops_on_token(params: Any, token: int, eos_ids: Iterable[int], generated: int) -> bool:
    """Whether ``token``, the row's next after ``generated`` tokens, ends it: an EOS token
    (unless ``ignore_eos``) or one of ``stop_token_ids``, once ``min_tokens`` are out
    (vLLM's rule: before that the token is banned from sampling, see :func:`apply`, but a
    grammar may still force it)."""
    if generated < params.min_tokens:
        return False
    return (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids


def check_token_ids(params: Any, vocab_size: int) -> None:
    """``logit_bias`` keys and ``stop_token_ids`` must be token ids of the vocabulary (a 400
    naming the field: an id the model has no logit for is not silently dropped)."""
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{name} holds token id {bad}, out of the vocabulary "
                                      f"(0 to {vocab_size - 1})", param=name,
                                      code="invalid_token_id")


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """vLLM's ``bad_words`` as token sequences: each word alone and after a space (how it is
    spelled at the start of the text and inside it), without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for spelled in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(spelled, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def needs_processing(params: Any) -> bool:
    return bool(params.logit_bias or params.bad_words or params.min_tokens
                or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


@dataclass(eq=False)
class RowLogits:
    """One row's processor state: made on its first step (see :func:`apply`)."""

    params: Any
    #: the tokens min_tokens bans until the row has that many (its EOS and stop tokens)
    end_ids: list[int]
    bad: list[tuple[int, ...]]
    #: (token ids, biases) of ``logit_bias``, as tensors on the logits' device
    bias: tuple[Any, Any] | None
    counts: Any = None
    prompt_mask: Any = None
    #: how many of the row's generated tokens ``counts`` holds
    counted: int = 0
    penalised: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.penalised = bool(p.presence_penalty or p.frequency_penalty
                              or p.repetition_penalty != 1.0)


def _state(row: Any, logits: Any, tokenizer: Any, eos_ids: Iterable[int]) -> RowLogits:
    import torch

    p = row.request.params
    vocab, device = logits.shape[-1], logits.device
    bias = None
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        bias = (torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32, device=device))
    state = RowLogits(p, [t for t in {*eos_ids, *p.stop_token_ids} if t < vocab],
                      bad_word_ids(tokenizer, p.bad_words) if p.bad_words else [], bias)
    if state.penalised:
        state.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            prompt = torch.tensor([t for t in row.request.prompt.input_ids if t < vocab],
                                  dtype=torch.long, device=device)
            state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            state.prompt_mask[prompt] = True
    return state


def _banned(state: RowLogits, generated: list[int]) -> list[int]:
    """The tokens this row may not take next: each bad word's last token where the output
    ends with the rest of it, and the end tokens before ``min_tokens``."""
    out = [seq[-1] for seq in state.bad
           if len(seq) == 1 or tuple(generated[len(generated) - len(seq) + 1:]) == seq[:-1]]
    if len(generated) < state.params.min_tokens:
        out += state.end_ids
    return out


def apply(rows: Sequence[Any], logits: Any, tokenizer: Any, eos_ids: Iterable[int]) -> Any:
    """``logits`` (rows, vocabulary) with each live row's processors applied: the same
    tensor when no row has one, else a processed copy. A row's state is kept in its
    ``logits_state``."""
    todo = [i for i, r in enumerate(rows) if not r.done and needs_processing(r.request.params)]
    if not todo:
        return logits
    import torch

    logits = logits.to(torch.float32, copy=True)
    penalised = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i in todo:
        row = rows[i]
        if row.logits_state is None:
            row.logits_state = _state(row, logits, tokenizer, eos_ids)
        state: RowLogits = row.logits_state
        banned = _banned(state, row.token_ids)
        ban_rows += [i] * len(banned)
        ban_ids += banned
        if state.bias is not None:
            logits[i].index_add_(0, *state.bias)
        if state.penalised:
            new = row.token_ids[state.counted:]
            if new:
                state.counts.index_add_(0, torch.tensor(new, dtype=torch.long,
                                                        device=logits.device),
                                        torch.ones(len(new), dtype=logits.dtype,
                                                   device=logits.device))
                state.counted = len(row.token_ids)
            penalised.append(i)
    if penalised:
        _penalise(logits, penalised, [rows[i].logits_state for i in penalised])
    if ban_ids:
        logits[ban_rows, ban_ids] = float("-inf")
    return logits


def _penalise(logits: Any, index: list[int], states: list[RowLogits]) -> None:
    """vLLM's ``apply_penalties`` on the rows ``index`` of ``logits``, in place, as one
    batched operation."""
    import torch

    at = torch.tensor(index, dtype=torch.long, device=logits.device)
    rows = logits.index_select(0, at)
    counts = torch.stack([s.counts for s in states])
    shape = (len(states), 1)

    def column(values: list[float]) -> Any:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device).view(shape)

    rep = column([s.params.repetition_penalty for s in states])
    seen = counts > 0
    prompt = [s.prompt_mask for s in states]
    if any(m is not None for m in prompt):
        seen = seen | torch.stack([m if m is not None else torch.zeros_like(seen[0])
                                   for m in prompt])
    rep = torch.where(seen, rep, torch.ones_like(rep))
    rows = torch.where(rows > 0, rows / rep, rows * rep)
    rows -= column([s.params.frequency_penalty for s in states]) * counts
    rows -= column([s.params.presence_penalty for s in states]) * (counts > 0).to(rows.dtype)
    logits.index_copy_(0, at, rows)
