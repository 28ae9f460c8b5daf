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
    most likely token, whatever the value (one that underflows in float32 keeps that one).

    The rows of a step together: one ``max`` for the greedy rows, then the sampling rows
    in chunks (all of them on an accelerator; on a CPU as many as fit
    :data:`CPU_CHUNK_BYTES` of logits: one row at a 152k vocabulary, whose passes then stay
    in the core's cache where a batch's would not), each chunk with one division by its
    temperatures, one top-k, one softmax, one min-p mask, top-p from the head of all its
    distributions together and one cumulative sum for the draw. Each operation is the
    per-row one's over each row (:func:`sample_per_row`, the reference the tests hold it
    to), so a seeded row draws the same tokens as it would alone; an unseeded row's uniform
    comes from one ``torch.rand`` for the chunk."""
    import torch

    live = [i for i, row in enumerate(rows) if row.request.params.temperature != 0]
    greedy = [i for i, row in enumerate(rows) if row.request.params.temperature == 0]
    tokens = [0] * len(rows)
    if greedy:  # (only those rows: a sampling row's argmax would be thrown away)
        part = logits if len(greedy) == len(rows) else logits.index_select(
            0, torch.tensor(greedy, dtype=torch.long, device=logits.device))
        # (the first maximal index, as argmax; torch's CPU max over a row is ~3x its argmax)
        for i, token in zip(greedy, part.max(dim=-1).indices.tolist(), strict=True):
            tokens[i] = token
    per = len(live) if logits.device.type != "cpu" else max(
        1, CPU_CHUNK_BYTES // (4 * logits.shape[-1]))
    for start in range(0, len(live), per):
        part = live[start:start + per]
        chunk = logits[part[0]:part[0] + 1] if len(part) == 1 else logits.index_select(
            0, torch.tensor(part, dtype=torch.long, device=logits.device))
        probs = filtered_probs([rows[i].request.params for i in part], chunk)
        drawn = _draw_rows(probs, [rows[i].generator for i in part])
        for i, token in zip(part, drawn, strict=True):
            tokens[i] = token
    return tokens


#: the most float32 logits the sampler's CPU chunk of rows holds (1 MiB: a quarter of this
#: machine's per-core L2, leaving room for the chunk's probabilities and cumulative sums)
CPU_CHUNK_BYTES = 1 << 20


def filtered_probs(params: Sequence[Any], logits: Any) -> Any:
    """The sampling rows' distributions (``logits`` one row per entry of ``params``, whose
    temperatures are not 0) after temperature, top-k, min-p and top-p, all rows at once:
    each row bit for bit what :func:`row_probs` makes of it alone."""
    import torch

    device = logits.device

    def column(values: list[float]) -> Any:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    scores = logits.float() / column([p.temperature for p in params])
    vocab = scores.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k and p.top_k > 0 else 0 for p in params]
    if any(top_k):
        _top_k_mask(scores, top_k)
    probs = torch.softmax(scores, dim=-1)
    if any(p.min_p > 0 for p in params):
        # (a row without min_p compares against 0: no probability is under it)
        floor = column([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < floor, 0.0)
    if any(p.top_p < 1.0 for p in params):
        probs = top_p_filter(probs, column([p.top_p for p in params]))
    return probs


def _top_k_mask(scores: Any, top_k: list[int]) -> None:
    """Sets to -inf, in place, each row's scores under its ``top_k``-th largest (rows with
    ``top_k`` 0 untouched): one top-k at the largest k for the rows that ask, each row's
    k-th value read from it (the same value a top-k at that row's own k ends with)."""
    import torch

    asking = [j for j, k in enumerate(top_k) if k]
    index = torch.tensor(asking, dtype=torch.long, device=scores.device)
    part = scores if len(asking) == len(top_k) else scores.index_select(0, index)
    values = torch.topk(part, max(top_k)).values
    kth = values.gather(1, torch.tensor([[top_k[j] - 1] for j in asking], dtype=torch.long,
                                        device=scores.device))
    if len(asking) == len(top_k):
        scores.masked_fill_(scores < kth, float("-inf"))
    else:
        scores.index_copy_(0, index, part.masked_fill_(part < kth, float("-inf")))


def _draw_rows(probs: Any, generators: Sequence[Any]) -> list[int]:
    """Each row's token from its ``probs``, all rows at once. A seeded row's uniform from its
    own generator through one cumulative sum of the seeded rows (:func:`_search_cdf`: the
    number and the sum its row alone would use, so the same token); the unseeded rows'
    from one ``torch.rand`` through a search by blocks (:func:`_search_blocks`: the same
    distribution, at a fraction of a cumulative sum over the vocabulary)."""
    import torch

    tokens = [0] * len(generators)
    for seeded in (False, True):
        picked = [j for j, g in enumerate(generators) if (g is not None) == seeded]
        if not picked:
            continue
        part = probs if len(picked) == len(generators) else probs.index_select(
            0, torch.tensor(picked, dtype=torch.long, device=probs.device))
        if seeded:
            found = _search_cdf(part, [generators[j].random() for j in picked])
        else:
            found = _search_blocks(part, torch.rand(len(picked), dtype=torch.float64))
        for j, token in zip(picked, found, strict=True):
            tokens[j] = token
    return tokens


def _search_cdf(probs: Any, draws: list[float]) -> list[int]:
    """Each row's first token whose cumulative mass passes its draw times the row's total:
    :func:`_draw`'s cumulative sum and search, for all rows at once."""
    import torch

    cdf = torch.cumsum(probs, 1, dtype=torch.float64)
    point = torch.tensor(draws, dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, point, right=True)[:, 0].tolist()
    vocab = probs.shape[-1]
    for j, token in enumerate(tokens):
        if token >= vocab:  # a draw that rounded up to the total mass: the last token
            tokens[j] = int(torch.nonzero(probs[j])[-1].item())  # with any mass
    return tokens


#: tokens per block of the unseeded rows' two-level search, and the fewest blocks it takes
#: (a smaller vocabulary's cumulative sum is cheaper than the search's extra steps:
#: scripts/sampler_bench.py; at 152k blocks take 0.14 ms a row where the sum took 0.18)
DRAW_BLOCK = 1024
DRAW_BLOCKS_MIN = 64


def _search_blocks(probs: Any, draws: Any) -> list[int]:
    """What :func:`_search_cdf` finds (short of a draw within rounding of a token's edge),
    in two levels: each row's block of :data:`DRAW_BLOCK` tokens from the cumulative sum
    of the blocks' masses (one vectorised pass over the row, where a cumulative sum over
    the vocabulary is a serial one), then the token inside it from that block's own
    cumulative sum. Never a token without mass: the search inside a block stops at a
    token whose mass lifts the sum past the draw."""
    import torch

    rows, vocab = probs.shape
    size = DRAW_BLOCK
    whole = vocab // size
    if whole < max(DRAW_BLOCKS_MIN, 2):
        return _search_cdf(probs, draws.tolist())
    sums = probs[:, :whole * size].view(rows, whole, size).sum(-1, dtype=torch.float64)
    if vocab % size:
        sums = torch.cat([sums, probs[:, whole * size:].sum(-1, True, dtype=torch.float64)], 1)
    blocks = torch.cumsum(sums, 1)
    point = draws.to(blocks.device)[:, None] * blocks[:, -1:]
    block = torch.searchsorted(blocks, point, right=True).clamp_(max=sums.shape[1] - 1)
    before = blocks.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    at = block * size + torch.arange(size, device=probs.device)
    inside = probs.gather(1, at.clamp(max=vocab - 1)).double().masked_fill_(at >= vocab, 0.0)
    offset = torch.searchsorted(torch.cumsum(inside, 1), point - before, right=True)
    tokens = (block * size + offset)[:, 0].tolist()
    for j, token in enumerate(tokens):
        if offset[j, 0] >= size or token >= vocab:  # (rounding past the block's mass: its
            mass = torch.nonzero(inside[j])  # last token with any, or the row's)
            tokens[j] = int(block[j, 0]) * size + int(mass[-1]) if len(mass) else int(
                torch.nonzero(probs[j])[-1])
    return tokens


def sample_per_row(rows: Sequence[Any], logits: Any) -> list[int]:
    """Each row's next token: greedy rows take the argmax; the others sample with their own
    temperature/min-p/top-k/top-p and generator (seeded per row). min-p (vLLM's) drops the
    tokens under ``min_p`` times the most likely one's probability; top-p keeps at least the
    most likely token, whatever the value (one that underflows in float32 keeps that one).

    One row at a time: the reference :func:`sample` (all rows at once) is held to by the
    tests and scripts/sampler_bench.py."""
    # (the first maximal index, as argmax; torch's CPU max over a row is ~3x its argmax)
    tokens = logits.max(dim=-1).indices.tolist()
    for i, row in enumerate(rows):
        if row.request.params.temperature != 0:
            tokens[i] = _draw(row_probs(row.request.params, logits[i]), row.generator)
    return tokens


def row_probs(p: Any, logits: Any) -> Any:
    """One sampling row's distribution after temperature, top-k, min-p and top-p, one row
    alone (:func:`sample_per_row`'s; :func:`filtered_probs` is all rows at once)."""
    import torch

    scores = logits.float() / p.temperature
    if p.top_k and p.top_k > 0:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        probs = _top_p_filter_row(probs, p.top_p)
    return probs


#: the most likely tokens top-p looks among first (then 16 times as many, then all of them)
TOP_P_FIRST = 1024


def top_p_filter(probs: Any, top_p: Any) -> Any:
    """``probs`` with only the most likely tokens whose mass before them is under ``top_p``
    (the most likely one always): one row, or a batch of rows (2-D) with a ``top_p`` for
    all or a column of one per row (a row at 1.0 or more is left whole). A sort of the
    whole vocabulary is what the rule reads, but only its head matters: the top
    :data:`TOP_P_FIRST` tokens of every row are sorted first, and a row whose last of them
    is already out, or has no mass, is done (every less likely token is out too, or has no
    mass to keep); the others' heads grow
    (16 times, then the whole row). (A language model's distribution is peaked: the head is
    nearly always enough, at a fraction of a 152k-token sort.) Each row comes out as
    :func:`_top_p_filter_row` leaves it, bit for bit."""
    import torch

    if probs.dim() == 1:
        return top_p_filter(probs[None], top_p)[0]
    count, n = probs.shape
    limits = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).reshape(-1, 1)
    limits = limits.expand(count, 1)
    pending = [j for j, v in enumerate(limits[:, 0].tolist()) if v < 1.0]
    if not pending:
        return probs
    keep_all = torch.zeros_like(probs, dtype=torch.bool)
    for j in set(range(count)) - set(pending):  # (rows left whole)
        keep_all[j] = True
    k = min(n, TOP_P_FIRST)
    while pending:
        every = len(pending) == count  # (then no copies of the rows: the usual case)
        index = torch.tensor(pending, dtype=torch.long, device=probs.device)
        part = probs if every else probs.index_select(0, index)
        if k < n:
            head, order = torch.topk(part, k)
        else:
            head, order = torch.sort(part, descending=True)
        keep = torch.cumsum(head, 1) - head < (limits if every else limits.index_select(0, index))
        # (a head ending in a token of no mass holds every token with any: min-p or top-k
        # took the rest out, and those zeros stay zeros whatever the rule says of them)
        grow = [False] * len(pending) if k == n else (keep[:, -1] & (head[:, -1] > 0)).tolist()
        done = [m for m, g in enumerate(grow) if not g]
        if every and len(done) == count:
            keep[:, 0] = True
            keep_all.scatter_(1, order, keep)
        elif done:
            at = torch.tensor(done, dtype=torch.long, device=probs.device)
            kept = keep.index_select(0, at)
            kept[:, 0] = True
            mask = torch.zeros((len(done), n), dtype=torch.bool, device=probs.device)
            mask.scatter_(1, order.index_select(0, at), kept)
            keep_all.index_copy_(0, index.index_select(0, at), mask)
        pending = [pending[m] for m, g in enumerate(grow) if g]
        k = min(n, k * 16)
    return probs.masked_fill(keep_all.logical_not_(), 0.0)


def _top_p_filter_row(probs: Any, top_p: float) -> Any:
    """:func:`top_p_filter` of one row (:func:`sample_per_row`'s): the head of
    :data:`TOP_P_FIRST` tokens first, grown 16 times while its last token is still in."""
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
