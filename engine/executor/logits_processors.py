"""The logits processors a request's sampling parameters ask for, on the batch's logits.

In vLLM's order (its v1 sampler): ``bad_words``, ``min_tokens`` (the row's end tokens banned
until it has that many), ``logit_bias``, then the penalties: ``repetition_penalty`` (vLLM's
and Hugging Face's rule, over the prompt's and the generated tokens: a positive logit divided
by it, a negative one multiplied), ``frequency_penalty`` (times each token's count in the
generated text) and ``presence_penalty`` (once per token that appeared in it: OpenAI's rule).
Temperature, ``min_p``, top-k and top-p come after, in the sampler.

Each row keeps its state (:class:`RowLogits`), made on its first step and brought up to
date with the tokens it accepted since (a dictionary look-up per token, not a count over its
whole output): the distinct tokens it has seen (its prompt's, when it has a repetition
penalty, and its generated ones) with each one's count in the generated text, on the CPU.
The penalties only change those tokens' logits, so a step gathers the seen entries of all
the penalised rows into one flat list, computes vLLM's formulas on it and scatters it back:
the work follows the rows' seen tokens, never the vocabulary (a dense (rows, vocabulary)
rewrite cost tens of milliseconds a step on a CPU at Qwen's 152k vocabulary). logit_bias and
the banned tokens are one scatter each over the batch. Rows without any processor cost
nothing, and neither does a batch without one.

The logits a row's log-probabilities report are those before these processors (vLLM's
default ``raw_logprobs``): :func:`apply` works on a copy when a live row asks for logprobs
(or the logits are not float32), else in place.

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
    #: (token ids, biases) of ``logit_bias``, as CPU tensors
    bias: tuple[Any, Any] | None
    #: where each seen token sits in ``seen`` and ``counts`` (penalised rows only)
    slot: dict[int, int] = field(default_factory=dict)
    #: the distinct seen tokens (the first ``size`` entries; capacity doubles when full) and
    #: how often each was generated, as CPU tensors
    seen: Any = None
    counts: Any = None
    size: int = 0
    #: how many of the row's generated tokens ``counts`` holds
    counted: int = 0
    #: (repetition, frequency, presence) penalties, when the row has any
    penalties: tuple[float, float, float] | None = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        penalised = bool(p.presence_penalty or p.frequency_penalty
                         or p.repetition_penalty != 1.0)
        self.penalties = ((float(p.repetition_penalty), float(p.frequency_penalty),
                           float(p.presence_penalty)) if penalised else None)

    def see(self, tokens: Sequence[int], vocab: int, *, generated: bool) -> None:
        """Add ``tokens`` to the seen set (counting them when ``generated``): a look-up
        per token, one copy of the new distinct ones and one scatter of the counts."""
        import torch

        fresh: list[int] = []
        slots: list[int] = []
        for t in tokens:
            if not 0 <= t < vocab:
                continue
            at = self.slot.get(t)
            if at is None:
                at = self.slot[t] = self.size + len(fresh)
                fresh.append(t)
            slots.append(at)
        if fresh:
            need = self.size + len(fresh)
            if self.seen is None or need > self.seen.numel():
                capacity = max(64, need, 2 * (self.size or 1))
                seen = torch.zeros(capacity, dtype=torch.long)
                counts = torch.zeros(capacity, dtype=torch.float32)
                if self.seen is not None:
                    seen[:self.size] = self.seen[:self.size]
                    counts[:self.size] = self.counts[:self.size]
                self.seen, self.counts = seen, counts
            self.seen[self.size:need] = torch.tensor(fresh, dtype=torch.long)
            self.size = need
        if generated and slots:
            if len(slots) == 1:
                self.counts[slots[0]] += 1
            else:
                self.counts.index_add_(0, torch.tensor(slots, dtype=torch.long),
                                       torch.ones(len(slots), dtype=torch.float32))


def _state(row: Any, vocab: int, tokenizer: Any, eos_ids: Iterable[int]) -> RowLogits:
    import torch

    p = row.request.params
    bias = None
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        bias = (torch.tensor(ids, dtype=torch.long),
                torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32))
    state = RowLogits(p, [t for t in {*eos_ids, *p.stop_token_ids} if 0 <= t < vocab],
                      bad_word_ids(tokenizer, p.bad_words) if p.bad_words else [], bias)
    if state.penalties is not None and p.repetition_penalty != 1.0:
        state.see(row.request.prompt.input_ids, vocab, generated=False)
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
    tensor, untouched, when no row has one; else processed in place, or in a float32 copy
    when a live row asks for logprobs (they report the raw logits) or the logits are not
    float32. A row's state is kept in its ``logits_state``."""
    todo = [i for i, r in enumerate(rows) if not r.done and needs_processing(r.request.params)]
    if not todo:
        return logits
    import torch

    vocab = logits.shape[-1]
    raw_needed = any(not r.done and getattr(r.request.params, "logprobs", None) is not None
                     for r in rows)
    with torch.inference_mode():  # (the model's logits are inference tensors)
        if raw_needed or logits.dtype != torch.float32 or not logits.is_contiguous():
            logits = logits.to(torch.float32, copy=True).contiguous()
        flat = logits.view(-1)
        penalised: list[tuple[int, RowLogits]] = []
        biased: list[tuple[int, RowLogits]] = []
        banned: list[int] = []
        for i in todo:
            row = rows[i]
            if row.logits_state is None:
                row.logits_state = _state(row, vocab, tokenizer, eos_ids)
            state: RowLogits = row.logits_state
            banned += [i * vocab + t for t in _banned(state, row.token_ids)]
            if state.bias is not None:
                biased.append((i, state))
            if state.penalties is not None:
                if state.counted < len(row.token_ids):
                    state.see(row.token_ids[state.counted:], vocab, generated=True)
                    state.counted = len(row.token_ids)
                if state.size:
                    penalised.append((i, state))
        if biased:
            _add_bias(flat, vocab, biased)
        if penalised:
            _penalise(flat, vocab, penalised)
        if banned:
            flat[torch.tensor(banned, dtype=torch.long, device=flat.device)] = float("-inf")
    return logits


def _offsets(vocab: int, index: list[int], sizes: list[int], total: int) -> Any:
    """Each entry's row start in the flattened logits: ``index[j] * vocab`` repeated
    ``sizes[j]`` times."""
    import torch

    return torch.repeat_interleave(torch.tensor(index, dtype=torch.long) * vocab,
                                   torch.tensor(sizes, dtype=torch.long), output_size=total)


def _add_bias(flat: Any, vocab: int, rows: list[tuple[int, RowLogits]]) -> None:
    """Every biased row's ``logit_bias`` added to the flattened logits: one scatter."""
    import torch

    sizes = [s.bias[0].numel() for _, s in rows]
    total = sum(sizes)
    if not total:
        return
    at = torch.cat([s.bias[0] for _, s in rows]) + _offsets(vocab, [i for i, _ in rows],
                                                            sizes, total)
    values = torch.cat([s.bias[1] for _, s in rows])
    flat.index_add_(0, at.to(flat.device), values.to(flat.device, flat.dtype))


def _penalise(flat: Any, vocab: int, rows: list[tuple[int, RowLogits]]) -> None:
    """vLLM's ``apply_penalties`` on the penalised rows of the flattened logits, in place,
    on their seen tokens only (the others it leaves as they are: a repetition penalty of 1
    and counts of 0 change nothing): one gather, vLLM's formulas, one scatter for all rows.
    """
    import torch

    sizes = [s.size for _, s in rows]
    total = sum(sizes)
    at = torch.cat([s.seen[:s.size] for _, s in rows]) + _offsets(
        vocab, [i for i, _ in rows], sizes, total)
    counts = torch.cat([s.counts[:s.size] for _, s in rows])
    columns = torch.repeat_interleave(
        torch.tensor([s.penalties for _, s in rows], dtype=torch.float32),
        torch.tensor(sizes, dtype=torch.long), dim=0, output_size=total)
    device = flat.device
    at, counts, columns = (t.to(device, non_blocking=True) for t in (at, counts, columns))
    rep, frequency, presence = columns.to(flat.dtype).unbind(1)
    counts = counts.to(flat.dtype)
    values = flat[at]
    values = torch.where(values > 0, values / rep, values * rep)
    values -= frequency * counts
    values -= presence * (counts > 0).to(values.dtype)
    flat[at] = values
