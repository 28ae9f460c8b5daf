"""A decode step's rotary cos and sin from a table of positions, filled by the model's own rotary
embedding.

A step of the lean decode path (:mod:`engine.models.lean_decode`) called the model's rotary
embedding for its rows' positions: a dozen small PyTorch operations (M-RoPE's sections split
and put back together included) right after a step that streamed every weight through the
caches, about 0.25-0.3 ms of a 43 M-parameter model's 5-7 ms step on two threads. Here they
are computed once per position, by the same module on the same kind of position tensor, in
blocks of :data:`BLOCK` positions as steps reach them, and a step gathers its rows' entries.

Every entry is the bits the module gives that position in a step: each of its operations is
elementwise over positions (a position times each inverse frequency, as a product or as a
matrix product with one term; cos and sin; sections copied; the attention scaling), and a
block's tensors are small enough that PyTorch computes them on one thread, vector by vector
from their start, as it does a step's (``tests/engine/test_rope_table.py`` compares them with
the module's output, batch by batch). Rotary embeddings whose frequencies change with the
length (``dynamic``, ``longrope``), outputs of another shape (per-section tables, as
Qwen2-VL's), a step whose three M-RoPE sections differ (never, in a decode step), and
positions past :data:`MAX_POSITIONS` or below zero go to the module itself.
"""

from __future__ import annotations

import threading
from typing import Any

#: positions computed together (a block's tensors stay under PyTorch's grain for splitting
#: an elementwise operation over threads; MAX_POSITIONS is a multiple)
BLOCK = 64
#: the table grows to at most this many positions (float32, head size 128: 128 MiB of cos
#: and sin at most, reached only by a row that many positions in); later ones go to the
#: module
MAX_POSITIONS = 1 << 17


class RopeTable:
    """``table(x, positions) -> (cos, sin)`` as ``rotary(x, positions)`` gives them for a
    decode step (positions ``(rows, 1)``, or M-RoPE's ``(3, rows, 1)`` expanded from one
    ``(rows, 1)``): ``(rows, 1, dim)`` each, from the table where it holds them, else from
    ``rotary``."""

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        kind = getattr(rotary, "rope_type", None)
        #: False where the module's frequencies may change with the sequence (or are unknown)
        self.enabled = isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"
        #: the filled rows of each store (what lookups read), by position form and dtype
        self._tables: dict[tuple[int, Any], tuple[Any, Any]] = {}
        self._stores: dict[tuple[int, Any], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, x: Any, positions: Any) -> tuple[Any, Any]:
        index = self._index(positions) if self.enabled else None
        if index is not None:
            found = self._lookup(index, positions.dim(), x)
            if found is not None:
                return found
        return self.rotary(x, positions)

    def filled(self, form: int, dtype: Any) -> tuple[Any, Any] | None:
        """The table's filled rows for positions of ``form`` (2: ``(rows, 1)``, 3: M-RoPE's)
        and hidden states of ``dtype``: ``(cos, sin)``, contiguous ``(positions, dim)`` each,
        row ``p`` the bits the module gives position ``p`` (what a lookup gathers); None
        where the table is off or holds none yet (a lookup through :meth:`__call__` fills
        it)."""
        return self._tables.get((form, dtype)) if self.enabled else None

    @staticmethod
    def _index(positions: Any) -> Any | None:
        """The rows' positions ``(rows,)``, or None for a form the table does not take."""
        if positions.dim() == 2 and positions.shape[1] == 1:
            return positions[:, 0]
        if positions.dim() == 3 and positions.shape[0] == 3 and positions.shape[2] == 1 and \
                positions.stride(0) == 0:  # (the three sections one tensor, expanded)
            return positions[0, :, 0]
        return None

    def _lookup(self, index: Any, form: int, x: Any) -> tuple[Any, Any] | None:
        key = (form, x.dtype)
        table = self._tables.get(key)
        if table is not None:
            try:
                return _gather(table, index)
            except (IndexError, RuntimeError):  # (past the table, or below zero)
                pass
        if index.numel() == 0:
            return None
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= MAX_POSITIONS:
            return None
        with self._lock:
            table = self._grown(key, high + 1, x)
        return None if table is None else _gather(table, index)

    def _grown(self, key: tuple[int, Any], size: int, x: Any) -> tuple[Any, Any] | None:
        """The table for ``key`` holding at least ``size`` positions (whole blocks), or None
        where the module's output is not one ``(1, positions, dim)`` tensor each. The
        entries live in a store of twice the room when it fills (a long answer's table is
        copied a logarithmic number of times, not once per block); lookups read views of its
        filled rows, so a position past them fails the lookup instead of reading an unfilled
        row."""
        import torch

        form = key[0]
        old = self._tables.get(key)
        have = 0 if old is None else old[0].shape[0]
        if have >= size:
            return old
        want = -(-size // BLOCK) * BLOCK
        probe = x.new_empty((1, 1, x.shape[-1]) if x.dim() else (1, 1, 1))
        store = self._stores.get(key)
        for start in range(have, want, BLOCK):
            block = torch.arange(start, start + BLOCK, dtype=torch.long, device=x.device)
            block = block.view(1, 1, -1).expand(3, 1, -1) if form == 3 else block.view(1, -1)
            cos, sin = self.rotary(probe, block)
            if cos.dim() != 3 or cos.shape[:2] != (1, BLOCK) or sin.shape != cos.shape:
                self.enabled = False
                return None
            if store is None or store[0].shape[0] < start + BLOCK:
                room = max(want, min(2 * (0 if store is None else store[0].shape[0]),
                                     MAX_POSITIONS))
                grown = tuple(cos.new_empty((room, cos.shape[-1])) for _ in range(2))
                if store is not None:
                    grown[0][:start] = store[0][:start]
                    grown[1][:start] = store[1][:start]
                store = self._stores[key] = grown
            store[0][start:start + BLOCK] = cos[0]
            store[1][start:start + BLOCK] = sin[0]
        table = (store[0][:want], store[1][:want])
        self._tables[key] = table
        return table


def _gather(table: tuple[Any, Any], index: Any) -> tuple[Any, Any]:
    """The rows' cos and sin, ``(rows, 1, dim)`` each, as the module gives a step's."""
    return table[0].index_select(0, index).unsqueeze(1), \
        table[1].index_select(0, index).unsqueeze(1)
