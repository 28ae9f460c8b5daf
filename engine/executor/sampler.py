"""Choosing each row's next token from its logits, and the logprobs a request asked for.

A row here is the runner's: its ``request.params`` (:class:`~engine.executor.sampling.
SamplingParams`), its own seeded ``generator`` and ``done``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.executor.request import TokenLogprobs


def logprobs(rows: Sequence[Any], logits: Any, tokens: list[int]) -> list[TokenLogprobs | None]:
    """For the rows whose request asked (``logprobs`` k not None), the sampled token's
    log-probability and rank and the k most likely tokens', in the model's raw
    distribution: log_softmax of the logits before temperature, top-k and top-p (vLLM's
    default ``logprobs_mode="raw_logprobs"``). One log_softmax and one top-k over those
    rows only; the others cost nothing."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows)
              if r.request.params.logprobs is not None and not r.done]
    if not wanted:
        return out
    import torch

    index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
    lps = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = torch.tensor([tokens[i] for i in wanted], dtype=torch.long,
                          device=lps.device)[:, None]
    picked = lps.gather(1, chosen)
    ranks = ((lps > picked).sum(dim=1) + 1).tolist()
    picked_list = picked[:, 0].tolist()
    k = min(max(rows[i].request.params.logprobs for i in wanted), lps.shape[-1])
    top_v: list[list[float]] = [[] for _ in wanted]
    top_i: list[list[int]] = [[] for _ in wanted]
    if k:
        top = torch.topk(lps, k, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].request.params.logprobs
        out[i] = TokenLogprobs(picked_list[j], int(ranks[j]), top_i[j][:n], top_v[j][:n])
    return out

def seeded_generator(seed: int) -> Any:
    """A row's own random stream from all 64 bits of its seed. torch's CPU generator seeds
    its Mersenne Twister from the low 32 bits alone (seeds 1 and 1 + 2**32 draw the same
    tokens); numpy's PCG64 takes the whole integer through its SeedSequence. A negative seed
    is taken modulo 2**64 (as torch does), one to one over the accepted range."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(seed % (1 << 64)))


def _draw(probs: Any, generator: Any) -> int:
    """One token from ``probs`` (not necessarily summing to 1): a uniform draw (the row's
    own generator, or torch's global stream for an unseeded row) through the cumulative
    distribution (the first token whose cumulative mass passes the draw: never one of mass
    0). (``torch.multinomial`` draws from the same distribution, but costs several times
    the cumulative sum on a CPU at a 152k vocabulary: scripts/penalties_bench.py.)"""
    import torch

    draw = generator.random() if generator is not None else float(
        torch.rand((), dtype=torch.float64))
    cdf = torch.cumsum(probs.double(), 0)
    point = torch.tensor([draw * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    token = int(torch.searchsorted(cdf, point, right=True).item())
    if token >= probs.numel():  # a draw that rounded up to the total mass: the last token
        token = int(torch.nonzero(probs)[-1].item())  # with any mass
    return token


def sample(rows: Sequence[Any], logits: Any) -> list[int]:
    """Each row's next token: greedy rows take the argmax; the others sample with their own
    temperature/min-p/top-k/top-p and generator (seeded per row). min-p (vLLM's) drops the
    tokens under ``min_p`` times the most likely one's probability; top-p keeps at least the
    most likely token, whatever the value (one that underflows in float32 keeps that one)."""
    import torch

    # (the first maximal index, as argmax; torch's CPU max over a row is ~3x its argmax)
    tokens = logits.max(dim=-1).indices.tolist()
    for i, row in enumerate(rows):
        p = row.request.params
        if p.temperature == 0:
            continue
        scores = logits[i].float() / p.temperature
        if p.top_k and p.top_k > 0:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            probs = top_p_filter(probs, p.top_p)
        tokens[i] = _draw(probs, row.generator)
    return tokens


#: the most likely tokens top-p looks among first (then 16 times as many, then all of them)
TOP_P_FIRST = 1024


def top_p_filter(probs: Any, top_p: float) -> Any:
    """``probs`` with only the most likely tokens whose mass before them is under ``top_p``
    (the most likely one always). A sort of the whole vocabulary is what the rule reads,
    but only its head matters: the top :data:`TOP_P_FIRST` tokens are sorted first, and
    when the last of them is already out, so is every less likely one; else the head
    grows. (A language model's distribution is peaked: the head is nearly always enough,
    at a fraction of a 152k-token sort.)"""
    import torch

    n = probs.numel()
    k = min(n, TOP_P_FIRST)
    while True:
        if k < n:
            head, order = torch.topk(probs, k)
        else:
            head, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(head, 0) - head < top_p
        if k == n or not bool(keep[-1]):
            break
        k = min(n, k * 16)
    keep[0] = True
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[keep]] = True
    return torch.where(mask, probs, torch.zeros_like(probs))
