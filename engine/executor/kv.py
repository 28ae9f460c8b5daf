"""The running batch's KV cache as rows join and leave between decode steps.

Every row's keys and values sit left-padded to one common length (the padding is masked out by
the batch's attention mask), so a decode step is one forward pass over all rows. Rows that
join are prefilled on their own cache and merged in (the shorter side padded on the left);
rows that leave are dropped by index, and columns that no remaining row uses are cut off.
"""

from __future__ import annotations

from typing import Any


def _layers(cache: Any) -> list[Any]:
    layers = list(cache.layers)
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(f"continuous batching needs full-attention caches; this "
                                      f"model has a {type(layer).__name__}")
    return layers


def _pad_left(t: Any, width: int) -> Any:
    import torch

    if t.shape[-2] == width:
        return t
    pad = t.new_zeros(*t.shape[:-2], width - t.shape[-2], t.shape[-1])
    return torch.cat([pad, t], dim=-2)


def merge(cache: Any, other: Any) -> Any:
    """``other``'s rows appended after ``cache``'s (in place on ``cache``), both left-padded to
    the longer length."""
    import torch

    width = max(cache.get_seq_length(), other.get_seq_length())
    for mine, theirs in zip(_layers(cache), _layers(other), strict=True):
        mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
        mine.values = torch.cat([_pad_left(mine.values, width),
                                 _pad_left(theirs.values, width)])
    return cache


def select(cache: Any, indices: list[int]) -> None:
    """Keep only these rows (in this order), in place."""
    import torch

    index = torch.tensor(indices, dtype=torch.long)
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))


def take(cache: Any, indices: list[int]) -> Any:
    """A new cache holding a copy of these rows; ``cache`` is left as it was."""
    import copy

    part = copy.copy(cache)
    part.layers = [copy.copy(layer) for layer in _layers(cache)]
    select(part, indices)
    return part


def drop_left(cache: Any, columns: int) -> None:
    """Cut the first ``columns`` positions (padding no row attends to), in place."""
    if columns <= 0:
        return
    for layer in _layers(cache):
        layer.keys = layer.keys[..., columns:, :]
        layer.values = layer.values[..., columns:, :]


def crop(cache: Any, length: int) -> None:
    """Back to ``length`` positions: undoes a step that failed after some layers grew."""
    for layer in _layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
