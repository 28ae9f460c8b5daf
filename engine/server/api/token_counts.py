"""Media tokens per request, by modality, for the ``aphrodite`` extension (``mm_tokens``):
how many prompt positions the model's media features fill, so a benchmark can report vision
and audio tokens per request and per second (``bench serve``'s ``mm_tokens``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any


def mm_token_counts(feature_ids: dict[str, int], prompts: Iterable[Any]) -> dict[str, int]:
    """Positions holding each modality's feature token, summed over ``prompts`` (each with
    ``input_ids``). Modalities that share one feature token (InternVL's images and videos)
    are counted together under their names joined by ``+``."""
    by_id: dict[int, list[str]] = {}
    for modality, token in feature_ids.items():
        by_id.setdefault(token, []).append(modality)
    counts: Counter[int] = Counter()
    for prompt in prompts:
        ids: Sequence[int] = prompt.input_ids
        counts.update(t for t in ids if t in by_id)
    return {"+".join(sorted(by_id[t])): n for t, n in counts.items() if n}
