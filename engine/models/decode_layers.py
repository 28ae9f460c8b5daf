"""A decode step's decoder layers in one call into the engine's C kernels
(``csrc/decode_step.c``: ``ap_decode_layers``), for the lean kernel step of
:mod:`engine.models.lean_decode`.

That step called the kernels one by one from Python: per layer four products, three small
operations, the cache's update and attention, each call checking its tensors and making its
outputs (about 60 calls a step, 1-2 ms of a 43 M model's 10 ms step at one row). Here the
weights' pointers are laid out once into an array of ``ap_layer`` records; a step fills in
each layer's cache buffer (after making room for one more column) and makes one call. The
kernels, their operands and their order are the same, so the results are the same bits as
the one-by-one step (``tests/engine/test_decode_layers.py``).

Where the embedding is a plain table and the head a kernel product, the embedding lookup, the
first layer's input norm and the head run in the same call (``ap_decode_step``): each of them
from Python was a few tensors made and checked on caches the step had just flushed with its
weights (0.2-0.35 ms of the 43 M model's 6-11 ms step). The layers' cache records are set
when a step finds other buffers than the last one left (the first step of a batch, a merge,
a split, a restore, buffers made again for more room); a step on the buffers and views its
predecessor left only checks that they are still those.

It runs where every layer's cache is a growing full-attention layer (with ``room`` and
``grow``: :func:`engine.executor.kv.reserve`) of float32 keys and values of the same length
and the mask covers them and the new column; otherwise (and with
``APHRODITE_DECODE_STEP_KERNEL=0``) the one-by-one step runs.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from engine import envs


class _Product(ctypes.Structure):
    _fields_ = [("panels", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_long), ("k", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("norm_after", ctypes.c_void_p), ("norm_next", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("ksr", "ksh", "ksc", "vsr", "vsh", "vsc"))]


def _takes(product: Any) -> bool:
    return all(hasattr(product, name) for name in ("panels", "scale", "bias", "shape"))


def _product(product: Any) -> _Product:
    scale = product.scale
    return _Product(product.panels.data_ptr(), None if scale is None else scale.data_ptr(),
                    None if product.bias is None else product.bias.data_ptr(),
                    *product.shape)


def build(lib: ctypes.CDLL, products: list[tuple[Any, Any, Any, Any]], norms_after: list[Any],
          norms_next: list[Any], heads: int, kv_heads: int, dim: int, eps: float,
          scalings: list[float], embed: Any = None, norm_first: Any = None,
          head: Any = None) -> Any | None:
    """The layers' runner ``(h, x, cos, sin, keep, cache) -> bool`` over the kernel products
    ``(qkv, o, gate_up, down)`` of each layer (:func:`engine.models.decode_kernels.linear`'s,
    kept alive by the caller) and its norms' weights (float32, copied here: the products'
    panels are copies too); None where the whole-step kernel or the attention kernel is off
    (the one-by-one step would run other products there), the library has none, or the
    layers are not alike (one attention scaling, matching widths) or past the attention
    kernel's limits. With the embedding table ``embed`` (float32 ``(vocab, hidden)``), the
    first layer's input norm ``norm_first`` and the head's kernel product ``head``, the runner
    also has ``step(ids, cos, sin, keep, cache) -> logits`` (``ap_decode_step``: the
    embedding, the norm, the layers and the head in the one call; None where those do not
    fit, or the library has no such entry)."""
    import torch

    from engine.models import decode_kernels

    if not envs.APHRODITE_DECODE_STEP_KERNEL or decode_kernels.library() is None or \
            not hasattr(lib, "ap_decode_layers") or \
            lib.ap_step_layer_bytes() != ctypes.sizeof(_Layer) or not products or \
            not all(_takes(p) for layer in products for p in layer) or \
            len(set(scalings)) != 1 or heads % kv_heads or \
            heads // kv_heads > lib.max_group or dim > lib.max_dim:
        return None
    shapes = {tuple(p.shape for p in layer) for layer in products}
    if len(shapes) != 1:
        return None
    (qkv_n, hidden), (o_n, o_k), (gu_n, gu_k), (down_n, down_k) = shapes.pop()
    if qkv_n != (heads + 2 * kv_heads) * dim or o_k != heads * dim or o_n != hidden or \
            gu_k != hidden or gu_n % 2 or down_k != gu_n // 2 or down_n != hidden or \
            not all(w.dtype == torch.float32 and w.shape == (hidden,)
                    for w in (*norms_after, *norms_next)):
        return None
    # (own copies: a pointer into a parameter's storage would dangle if it moved)
    norms_after = [w.detach().clone().contiguous() for w in norms_after]
    norms_next = [w.detach().clone().contiguous() for w in norms_next]
    count = len(products)
    table = (_Layer * count)()
    for record, (qkv, o, gate_up, down), after, then in zip(
            table, products, norms_after, norms_next, strict=True):
        record.qkv, record.o = _product(qkv), _product(o)
        record.gate_up, record.down = _product(gate_up), _product(down)
        record.norm_after, record.norm_next = after.data_ptr(), then.data_ptr()
    scaling = scalings[0]
    keep_alive: tuple[Any, ...] = (products, norms_after, norms_next)
    lock = threading.Lock()  # (one table: one call at a time)

    # What the table's cache records were last set from (under ``lock``): the layers, their
    # key and value buffers, the columns the layers held after the last step's grow, the
    # buffers' least capacity and their rows. While every layer still holds those buffers
    # and the views its last grow made (nothing merged, split, restored or grown since) and
    # there is room, the records stand and a step skips the checks and ``room`` below: on
    # the caches a step has just flushed, they were ~0.2 ms of a 43 M model's 6 ms step.
    bound_to: dict[str, Any] = {"layers": (), "used": -1, "capacity": 0, "rows": 0}

    def still_bound(layers: list[Any], used: int) -> bool:
        known = bound_to["layers"]  # (each layer with its key and value buffers)
        return used == bound_to["used"] and used + 1 <= bound_to["capacity"] and \
            len(layers) == len(known) and all(
                layer is was and layer.holds(kbuf, vbuf)
                for layer, (was, kbuf, vbuf) in zip(layers, known, strict=True))

    def grown(layers: list[Any], used: int) -> None:
        """Each layer one column longer after a call (under ``lock``)."""
        for layer in layers:
            layer.grow(1)
        bound_to["used"] = used + 1

    def bound(rows: int, keep: Any, cos: Any, sin: Any, cache: Any, more: tuple[Any, ...]
              ) -> tuple[list[Any], int] | None:
        """The cache's layers and the columns they hold, each layer's buffers (with room for
        one more) in the table, where these tensors and caches are for the kernel; else
        None. Called under ``lock``."""
        layers = list(getattr(cache, "layers", ()))
        if len(layers) != count or rows <= 0 or \
                keep.dtype != torch.bool or keep.dim() != 2 or keep.shape[0] != rows or \
                keep.shape[1] < 2 or keep.stride(-1) != 1 or \
                not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
                        for t in (*more, cos, sin)) or \
                cos.shape != (rows, dim) or sin.shape != cos.shape:
            return None
        used = keep.shape[1] - 1  # (the columns every layer's cache must hold)
        if still_bound(layers, used) and bound_to["rows"] == rows:
            return layers, used
        bound_to["used"] = -1  # (unbound until the records below are all set)
        for layer in layers:
            # (a growing full-attention layer: engine.executor.kv.reserve's)
            if not hasattr(layer, "grow") or not getattr(layer, "is_initialized", False):
                return None
            keys, values = layer.keys, layer.values
            if keys.dtype != torch.float32 or values.dtype != torch.float32 or \
                    keys.shape != (rows, kv_heads, used, dim) or values.shape != keys.shape or \
                    not keys.is_cpu or not values.is_cpu:
                return None
        buffers = [layer.room(1) for layer in layers]
        for record, (kbuf, vbuf, _) in zip(table, buffers, strict=True):
            if kbuf.stride(3) != 1 or vbuf.stride(3) != 1:
                return None
            record.keys, record.values = kbuf.data_ptr(), vbuf.data_ptr()
            record.ksr, record.ksh, record.ksc = kbuf.stride()[:3]
            record.vsr, record.vsh, record.vsc = vbuf.stride()[:3]
        bound_to.update(layers=tuple((layer, k, v) for layer, (k, v, _) in
                                     zip(layers, buffers, strict=True)),
                        capacity=min(k.shape[2] for k, _, _ in buffers), rows=rows)
        run.rebinds += 1  # type: ignore[attr-defined]
        return layers, used

    def run(h: Any, x: Any, cos: Any, sin: Any, keep: Any, cache: Any) -> bool | None:
        """The layers on ``h`` (rows, hidden) and ``x`` (its first norm), ``keep`` the
        rows' contiguous bool mask of their columns and the new one: True when done (``h``
        and ``x`` the step's, each cache one column longer); False where these tensors or
        caches are not for it (nothing touched); None where it failed part-way (a buffer
        could not be had: ``h`` and ``x`` are no longer the step's, so run the step again;
        the caches are as they were)."""
        rows = h.shape[0]
        if h.shape != (rows, hidden) or x.shape != h.shape:
            return False
        with lock:
            found = bound(rows, keep, cos, sin, cache, (h, x))
            if found is None:
                return False
            layers, used = found
            if lib.ap_decode_layers(table, count, rows, heads, kv_heads, dim, eps, scaling,
                                    h.data_ptr(), x.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), keep.data_ptr(), keep.stride(0), used,
                                    torch.get_num_threads()):
                return None
            grown(layers, used)
        return True

    run.keep_alive = keep_alive  # type: ignore[attr-defined]
    run.step = run.step_at = None  # type: ignore[attr-defined]
    #: how many times the table's cache records were set (see ``bound_to``; the tests)
    run.rebinds = 0  # type: ignore[attr-defined]
    if embed is None or norm_first is None or head is None or \
            not hasattr(lib, "ap_decode_step") or not _takes(head) or \
            head.shape[1] != hidden or embed.dtype != torch.float32 or \
            embed.dim() != 2 or embed.shape[1] != hidden or not embed.is_cpu or \
            norm_first.dtype != torch.float32 or norm_first.shape != (hidden,):
        return run
    embed = embed.detach().contiguous()  # (a view of the model's own table where it is one)
    norm_first = norm_first.detach().clone().contiguous()
    head_record = _product(head)
    vocab, logits_n = embed.shape[0], head.shape[0]
    keep_alive += (embed, norm_first, head, head_record)
    run.keep_alive = keep_alive  # type: ignore[attr-defined]

    def step(ids: Any, cos: Any, sin: Any, keep: Any, cache: Any) -> Any:
        """``ids`` (rows, 1) int64 through the embedding, the layers and the head: the
        step's logits ``(rows, vocab)``, each cache one column longer; False where these
        tensors or caches are not for it, or an id is not in the table (nothing touched);
        None where it failed part-way (the caches are as they were)."""
        rows = ids.shape[0]
        if ids.dtype != torch.int64 or ids.shape != (rows, 1) or not ids.is_cpu or \
                not ids.is_contiguous():
            return False
        logits = torch.empty(rows, logits_n, dtype=torch.float32)
        with lock:
            found = bound(rows, keep, cos, sin, cache, ())
            if found is None:
                return False
            layers, used = found
            failed = lib.ap_decode_step(table, count, rows, heads, kv_heads, dim, eps,
                                        scaling, embed.data_ptr(), vocab, ids.data_ptr(),
                                        norm_first.data_ptr(), ctypes.addressof(head_record),
                                        logits.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                        keep.data_ptr(), keep.stride(0), used,
                                        torch.get_num_threads())
            if not failed:
                grown(layers, used)
        if failed == -2:
            return False
        if failed:
            return None
        return logits

    logits_buffer: list[Any] = [None]  # (step_at's, reused while the rows' count stays)

    def step_at(ids: Any, positions: Any, cos_table: Any, sin_table: Any, keep: Any,
                columns: int, cache: Any, argmax: Any) -> Any:
        """``step`` for rows given as ctypes int64 arrays (``ids``, ``positions``: no tensors
        made for them) on the caches the last step left (its records still bound: anything
        else is False, for ``step``): each row's cos and sin are the row of ``cos_table`` and
        ``sin_table`` (float32 ``(positions, dim)``, :class:`engine.models.rope_table.RopeTable`'s)
        at its position, gathered in the call, the mask the first ``columns`` of ``keep``'s
        rows, and ``argmax`` (an int64 array) gets each row's first maximal logit. The logits
        ``(rows, vocab)``: one buffer, written again by the next step of as many rows (so no
        tensor is made before the call: read them before it); False where these are not for
        it, an id is not in the table or a position past the tables (nothing touched); None
        where it failed part-way (the caches are as they were)."""
        rows = len(ids)
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list) or keep.dtype != torch.bool or keep.dim() != 2 or \
                keep.shape[0] != rows or keep.stride(-1) != 1 or len(positions) != rows or \
                not 2 <= columns <= keep.shape[1] or \
                len(argmax) != rows or cos_table.dtype != torch.float32 or \
                sin_table.shape != cos_table.shape or cos_table.dim() != 2 or \
                cos_table.shape[1] != dim or not cos_table.is_contiguous() or \
                not sin_table.is_contiguous() or sin_table.dtype != torch.float32:
            return False
        used = columns - 1
        logits = logits_buffer[0]
        if logits is None or logits.shape[0] != rows:
            logits = logits_buffer[0] = torch.empty(rows, logits_n, dtype=torch.float32)
        with lock:
            if rows <= 0 or bound_to["rows"] != rows or not still_bound(layers, used):
                return False
            failed = lib.ap_decode_step_at(
                table, count, rows, heads, kv_heads, dim, eps, scaling, embed.data_ptr(), vocab,
                ctypes.addressof(ids), norm_first.data_ptr(), ctypes.addressof(head_record),
                logits.data_ptr(), ctypes.addressof(positions), cos_table.data_ptr(),
                sin_table.data_ptr(), cos_table.shape[0], ctypes.addressof(argmax),
                keep.data_ptr(), keep.stride(0), used, torch.get_num_threads())
            if not failed:
                grown(layers, used)
        if failed in (-2, -3):
            return False
        if failed:
            return None
        return logits

    run.step = step  # type: ignore[attr-defined]
    run.step_at = step_at if hasattr(lib, "ap_decode_step_at") else None  # type: ignore
    return run
