"""Rotary position embedding applied to a query or key (the decode steps' shared arithmetic)."""

from __future__ import annotations

from typing import Any


def rotate(x: Any, cos: Any, sin: Any) -> Any:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) *
    sin`` (``cos``/``sin`` already gathered for the positions and broadcastable to ``x``)."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
