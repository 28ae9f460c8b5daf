"""``--compile-decode``'s batch-size buckets (engine.models.lean_compile): a step of ``rows``
rows runs as the smallest compiled bucket holding them, and the buckets reach
``--max-num-seqs`` (vLLM's CUDA graph sizes, on a CPU)."""

from __future__ import annotations

import pytest

from engine.models.lean_compile import BUCKETS, bucket_of, buckets_for


@pytest.mark.parametrize(("max_rows", "want"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (256, [1, 2, 4, 8, 16, 32, 64, 128, 256]), (1000, [*BUCKETS, 1000])])
def test_the_buckets_grow_by_doubling_up_to_the_batch(max_rows, want):
    assert buckets_for(max_rows) == want


@pytest.mark.parametrize(("rows", "want"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_step_runs_as_the_smallest_bucket_holding_its_rows(rows, want):
    assert bucket_of(rows, buckets_for(8)) == want
