"""The sampler takes the rows of a step together (engine/executor/sampler.py ``sample``):
each row's filtered distribution is bit for bit what the row alone makes of it
(``row_probs``, the per-row path), so seeded rows draw the same tokens together as alone,
and unseeded rows draw from the same distribution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

#: one row of each kind a batch mixes: greedy, unseeded and seeded, each filter alone and
#: together (min-p taking out more mass than top-p leaves: top-p's head ends in zeros)
KINDS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, seed=3),
         dict(temperature=0.7, min_p=0.05, seed=4), dict(temperature=0.9, top_k=50, seed=5),
         dict(temperature=0.7, top_p=0.9, seed=6), dict(temperature=0.6, top_p=0.5),
         dict(temperature=1.3, top_k=3000, min_p=0.2, top_p=0.999, seed=7),
         dict(temperature=0.8, top_k=10**9, seed=8), dict(temperature=2.0, top_p=0.97),
         dict(temperature=0.5, min_p=0.5, top_k=7)]


def _rows(kinds=KINDS):
    from engine import SamplingParams
    from engine.executor import sampler

    return [SimpleNamespace(
        done=False, request=SimpleNamespace(params=SamplingParams(max_tokens=4, **kind)),
        generator=sampler.seeded_generator(kind["seed"]) if "seed" in kind else None)
        for kind in kinds]


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (top-p's head grows) to peaked
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # (bfloat16: many tied logits)
def test_a_batchs_filtered_distributions_are_each_rows_alone_bit_for_bit(scale, dtype):
    """Ties included: top-k and top-p keep the same one of two equal tokens at their edge."""
    import torch

    from engine.executor import sampler

    params = [r.request.params for r in _rows() if r.request.params.temperature]
    gen = torch.Generator().manual_seed(int(scale * 10))
    for _ in range(2):
        logits = (torch.randn(len(params), 50000, generator=gen) * scale).to(
            getattr(torch, dtype))
        together = sampler.filtered_probs(params, logits)
        for j, p in enumerate(params):
            assert torch.equal(together[j], sampler.row_probs(p, logits[j])), p


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 40])  # one row per chunk; all in one
@pytest.mark.parametrize("blocks_min", [2, 64])  # unseeded rows: by blocks; one cumsum
def test_seeded_rows_draw_the_same_tokens_together_as_alone(monkeypatch, chunk_bytes,
                                                             blocks_min):
    """Over steps of changing logits, the rows of a batch take the tokens the per-row
    sampler gives them: seeded rows from their own streams, greedy rows their argmax (and
    with torch's global stream reseeded alike, the unseeded rows too: their search by
    blocks finds the cumulative sum's token short of a draw within rounding of an edge)."""
    import torch

    from engine.executor import sampler

    monkeypatch.setattr(sampler, "CPU_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(sampler, "DRAW_BLOCKS_MIN", blocks_min)
    together, alone = _rows(), _rows()
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for step in range(30):
        logits = torch.randn(len(KINDS), 3000, generator=gen) * (0.5 + step % 4 * 3)
        torch.manual_seed(step)
        got = sampler.sample(together, logits)
        torch.manual_seed(step)
        assert got == sampler.sample_per_row(alone, logits)
        seen.update(enumerate(got))
    assert len(seen) > 3 * len(KINDS)  # (the draws did vary)


def test_unseeded_rows_drawn_together_follow_each_rows_distribution():
    import torch

    from engine.executor import sampler

    rows = _rows([dict(temperature=1.0)] * 3 + [dict(temperature=1.0, seed=9)])
    logits = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.75, 0.0, 0.25, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.5, 0.0, 0.0]]).log()

    def draws():
        torch.manual_seed(5)
        return [sampler.sample(rows, logits) for _ in range(1000)]

    got = draws()
    columns = list(zip(*got, strict=True))
    assert set(columns[0]) == {1, 3} and 0.21 < columns[0].count(1) / len(got) < 0.29
    assert set(columns[1]) == {0, 2} and 0.71 < columns[1].count(0) / len(got) < 0.79
    assert set(columns[2]) == {4}
    assert set(columns[3]) == {1, 2}
    rows = _rows([dict(temperature=1.0)] * 3 + [dict(temperature=1.0, seed=9)])
    assert draws() == got  # (torch.manual_seed repeats the unseeded rows)


def test_the_unseeded_search_by_blocks_finds_the_cumulative_sums_token(monkeypatch):
    """The unseeded rows' two-level search (blocks of DRAW_BLOCK tokens, a last block
    shorter) takes the token the cumulative sum over the whole row does, never one without
    mass, at the edges of the draw too."""
    import torch

    from engine.executor import sampler

    monkeypatch.setattr(sampler, "DRAW_BLOCKS_MIN", 2)  # (4 blocks of 1024 and one of 4)
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(6, 4100, generator=gen) * 4, dim=-1)
    probs[torch.rand(6, 4100, generator=gen) < 0.5] = 0.0
    probs[1, :3072] = 0.0  # (mass only in the last blocks)
    probs[2, 1024:] = 0.0  # (only in the first)
    probs[3, :-3] = 0.0  # (only in the short last block)
    for draws in [torch.zeros(6, dtype=torch.float64),
                  torch.full((6,), 1 - 2.0 ** -53, dtype=torch.float64),
                  *torch.rand(300, 6, generator=gen, dtype=torch.float64)]:
        got = sampler._search_blocks(probs, draws)
        assert got == sampler._search_cdf(probs, draws.tolist())
        assert all(probs[j, t] > 0 for j, t in enumerate(got))
