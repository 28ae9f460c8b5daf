"""A decode step of a plain pre-norm decoder (Qwen2, Qwen2-VL, Qwen2.5-VL, Llama text models)
run layer by layer with the model's own weights and the same operations in the same order as
its transformers code, without that code's machinery around them.

On a small model a decode step is mostly Python: each of transformers' modules goes through
``nn.Module.__call__``, its decorators (output capture, kwarg checks, config lookups), the
attention-function registry and a mask built column by column. Here the step calls the
layers' weights directly: the embedding, the model's own rotary embedding (M-RoPE included;
its cos and sin per position computed once, :mod:`engine.models.rope_table`), each layer's
RMS norms, q/k/v projections, rotation, cache update, :func:`engine.models.attention.
attention` (what the model's attention calls), output projection and MLP, then the final norm
and the LM head. Logits equal the model's forward bit for bit (test_lean_decode); a
step of the tiny Qwen2.5-VL with 8 rows takes 1.5 ms instead of 2.1 ms.

Each layer's q/k/v products run as one product and its gate/up products as one
(``APHRODITE_LEAN_DECODE_FUSED``), over weights concatenated once when the step is built; the
layers' own weights become views of the concatenations, so only a oneDNN-packed copy (where
:mod:`engine.models.cpu_linear` packs a weight of that size) is added. Every output column is
the same sum as before; a packed kernel may block the sums differently for a wider weight,
which the tests bound (they found none on the tiny and the 43 M-parameter models). On the
43 M-parameter model it took 2% off a step on one thread at batch 1 and 8, 4-5% on the
tiny one (interleaved in one process).
Where the engine's linear kernel is built (:func:`engine.models.decode_kernels.linear`, on by
default), every float32 product of the step (the fused q/k/v and gate/up, o, down and the
head) runs through it over its own packed copy of the weight (the fused products' oneDNN copy
is then not made, unless ``--compile-decode`` needs it): 1.26x less time a step of 8 rows of
the 150 M-parameter model. It takes steps of any number of rows: one of many
(``--max-num-seqs 256``, say) is not sent to oneDNN's product, whose other sums would change a
row's logits with the size of its batch (its products then take about 1.1-1.3x oneDNN's
time on this project's AVX2 machine: docs/performance.md). Its sums are ordered differently from
PyTorch's, so then the logits are within rounding of the model's forward, not its bits
(``tests/engine/test_decode_linear.py``); the tiny test models' weights are under its
minimum, and there the bit-for-bit test holds. Where every product of
the step runs through it, the small operations between them do too
(:func:`_with_kernels`: the residual add with the next RMS norm, the rotation of q and k,
SiLU(gate) * up, each one C call for all the rows instead of several PyTorch calls over cold
memory): the 43 M-parameter model's step of 4 rows 17.9 -> 14.1 ms. With both kernels, a
row's logits are the same bits whatever its batch-mates and their number (tested past 64
rows).
With ``--quantization int8`` the layers hold int8 rows and a scale per row
(:mod:`engine.models.int8_linear`); they are fused the same way (rows and scales
concatenated) and multiplied by the linear kernel over int8 panels
(:func:`engine.models.decode_kernels.linear_int8`), or by that module's product where the
kernel does not take them; with every product on the kernel the small operations run in C
as for float weights.

Only the text models registered in :data:`DECODERS` (by their config's ``model_type``), on the
engine's attention (:mod:`engine.models.attention`), without sliding-window layers, on a CPU
device are run so; anything else (another family, eager or flash attention, a GPU: there a
step without padding runs SDPA without a mask, which this step would not match bit for bit,
``APHRODITE_LEAN_DECODE=0``) runs the model's forward. :func:`for_model` decides once, when
the runner starts.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from engine import envs
from engine.models import attention, cpu_linear, decode_kernels, decode_layers, parts, rope_table
from engine.models.rotary import rotate

logger = logging.getLogger(__name__)

#: text models whose layers are the plain pre-norm decoder this step runs: their config's
#: ``model_type`` (the text config's, for a multimodal model)
DECODERS = frozenset({"qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "llama"})

Step = Callable[[Any, Any, Any, Any], Any]


def _rms(norm: Any, x: Any) -> Any:
    """transformers' Qwen2/Llama RMSNorm: in float32, then back to the input's dtype."""
    import torch

    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def for_model(model: Any, compile_rows: int | None = None, threads: int = 1) -> Step | None:
    """The lean decode step for ``model`` (``step(ids, mask, positions, cache)``: ids
    ``(rows, 1)``, the rows' 2-D padding mask over the cache plus the new column, positions as
    the model's forward takes them; the last logits, ``(rows, vocab)``), or None where the
    model's own forward must run. ``compile_rows``: batches of up to that many rows also get
    compiled graphs (``--compile-decode``: a :class:`engine.models.lean_compile.CompiledStep`,
    to compile on ``threads`` torch threads once its ``start`` is called) where the model
    allows them (else the eager step, with a log line saying why)."""
    text = parts.language_model(model)
    config = getattr(text, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not envs.APHRODITE_LEAN_DECODE or config is None or head is None or \
            next(model.parameters()).device.type != "cpu" or \
            getattr(config, "model_type", None) not in DECODERS or \
            getattr(config, "_attn_implementation", None) != attention.NAME:
        return None
    types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in types) or getattr(config, "use_sliding_window", False):
        return None
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if not all(hasattr(text, name) for name in needed):
        return None
    layers = list(text.layers)
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in (
                "q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")) or \
                not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj",
                                                  "act_fn")):
            return None
    return _step(text, layers, head, compile_rows, threads)


class _Fused:
    """One layer's q/k/v products as one product and its gate/up products as one: their
    weights concatenated once (the layers' own weights become views of the concatenation,
    so nothing is held twice but a packed copy, see :func:`engine.models.cpu_linear.
    prepared`). For the compiled step (:mod:`engine.models.lean_compile`) the float
    concatenations and their packed copies are kept (``*_weights`` None for int8 rows)."""

    def __init__(self, layer: Any, wide: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [m.bias for m in qkv]
        self.splits = [m.out_features for m in qkv]
        self.qkv_bias = None if biases[0] is None else _concatenated(biases)
        self._qkv, self.qkv_weights = _product(qkv, self.qkv_bias, wide)
        self.width = mlp.gate_proj.out_features
        self._gate_up, self.gate_up_weights = _product((mlp.gate_proj, mlp.up_proj), None,
                                                       wide)
        self.qkv_blocked = getattr(self._qkv, "blocked", None)
        self.gate_up_blocked = getattr(self._gate_up, "blocked", None)

    def qkv(self, x: Any) -> Any:
        return self._qkv(x).split(self.splits, dim=-1)

    def gate_up(self, x: Any) -> Any:
        out = self._gate_up(x)
        return out[..., :self.width], out[..., self.width:]


def _product(linears: tuple[Any, ...], bias: Any, wide: bool
             ) -> tuple[Callable[[Any], Any], Any]:
    """One product over ``linears``' weights concatenated (see :class:`_Fused`), and the
    concatenated float weight (None for int8): float ones through the linear kernel
    (:func:`engine.models.decode_kernels.linear`) where it takes them, with a
    :func:`engine.models.cpu_linear.prepared` (oneDNN) copy kept beside it only when ``wide``
    (the compiled step's), else through ``prepared``; int8 ones (``--quantization int8``,
    rows and scales concatenated alike: a scale belongs to its row) through the kernel's int8 panels
    (:func:`engine.models.decode_kernels.linear_int8`) where it takes them, with
    :func:`engine.models.int8_linear.product` for wider inputs, else through that alone."""
    if getattr(linears[0], "qweight", None) is None:
        weight = _concatenated([m.weight for m in linears])
        packed = cpu_linear.prepared(weight, bias) if wide else None
        kernel = decode_kernels.linear(weight, bias, packed)
        return kernel or packed or cpu_linear.prepared(weight, bias), weight
    from engine.models import int8_linear

    rows = _concatenated([m.qweight for m in linears])
    scales = _concatenated([m.scale for m in linears])

    def int8(x: Any) -> Any:
        return int8_linear.product(x, rows, scales, bias)

    return decode_kernels.linear_int8(rows, scales, bias, int8) or int8, None


def _concatenated(tensors: list[Any]) -> Any:
    """``tensors`` concatenated along their first dimension; each tensor's data becomes its
    rows of the result (a view: the memory is not held twice)."""
    import torch

    with torch.no_grad():
        whole = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            t.data = whole[start:start + t.shape[0]]
            start += t.shape[0]
    return whole


def _fusable(layer: Any) -> bool:
    import torch

    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    linears = (*qkv, mlp.gate_proj, mlp.up_proj)
    # all float weights, or all int8 rows (--quantization int8), never a mix
    name = "qweight" if getattr(linears[0], "qweight", None) is not None else "weight"
    if not all(isinstance(getattr(m, name, None), torch.Tensor) and
               isinstance(getattr(m, "out_features", None), int) for m in linears):
        return False
    weights = [getattr(m, name) for m in linears]
    same = all(w.dtype == weights[0].dtype and w.device == weights[0].device and
               w.shape[1] == weights[0].shape[1] for w in weights)
    biases = [getattr(m, "bias", None) for m in qkv]
    return same and getattr(mlp.gate_proj, "bias", None) is None and \
        getattr(mlp.up_proj, "bias", None) is None and \
        (all(b is None for b in biases) or all(b is not None for b in biases))


def _single(module: Any) -> Callable[[Any], Any]:
    """``module``'s product for the step: the linear kernel's over its float weight, or its
    int8 rows and scales, where it takes them (the module's own forward for other inputs),
    else the module's forward."""
    weight = getattr(module, "weight", None)
    if getattr(module, "qweight", None) is not None:
        return decode_kernels.linear_int8(module.qweight, module.scale,
                                          getattr(module, "bias", None),
                                          module.forward) or module.forward
    if weight is None:
        return module.forward
    return decode_kernels.linear(weight, getattr(module, "bias", None),
                                 module.forward) or module.forward


def _step(text: Any, layers: list[Any], head: Any, compile_rows: int | None = None,
          threads: int = 1) -> Step:
    # (the compiled step keeps the fused products' oneDNN copies: see _product)
    wide = compile_rows is not None
    fused = [_Fused(layer, wide) if envs.APHRODITE_LEAN_DECODE_FUSED and _fusable(layer)
             else None for layer in layers]
    step = _eager(text, layers, head, fused)
    if compile_rows is None:
        return _with_kernels(text, layers, head, fused, step) or step
    from engine.models import lean_compile

    why = lean_compile.eligible(text, layers, fused, head)
    if why is not None:
        logger.warning("--compile-decode: the eager decode step runs (%s)", why)
        return step
    return lean_compile.CompiledStep(text, layers, head, fused, step, compile_rows, threads)


def _eager(text: Any, layers: list[Any], head: Any, fused: list[_Fused | None]) -> Step:
    embed, final_norm = text.embed_tokens, text.norm
    rotary = rope_table.RopeTable(text.rotary_emb)
    outs = [_single(layer.self_attn.o_proj) for layer in layers]
    downs = [_single(layer.mlp.down_proj) for layer in layers]
    last = _single(head)

    def step(ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        rows = ids.shape[0]
        h = embed.forward(ids)
        cos, sin = rotary(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        frame = mask.bool()[:, None, None, :]  # what attention.mask gives a decode step
        for i, layer in enumerate(layers):
            attn, mlp, both = layer.self_attn, layer.mlp, fused[i]
            dim = attn.head_dim
            x = _rms(layer.input_layernorm, h)
            if both is not None:
                q, k, v = both.qkv(x)
            else:
                q, k, v = attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)
            q = q.view(rows, 1, -1, dim).transpose(1, 2)
            k = k.view(rows, 1, -1, dim).transpose(1, 2)
            v = v.view(rows, 1, -1, dim).transpose(1, 2)
            k, v = cache.update(rotate(k, cos, sin), v, i)
            out, _ = attention.attention(attn, rotate(q, cos, sin), k, v, frame,
                                         scaling=attn.scaling)
            h = h + outs[i](out.reshape(rows, 1, -1).contiguous())
            x = _rms(layer.post_attention_layernorm, h)
            if both is not None:
                gate, up = both.gate_up(x)
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
            h = h + downs[i](mlp.act_fn(gate) * up)
        return last(_rms(final_norm, h)[:, -1, :])

    products = [*outs, *downs, last, *(p for f in fused if f is not None
                                       for p in (f._qkv, f._gate_up))]
    #: how many of the step's products run through the linear kernel (bench decode-step)
    step.kernel_products = sum(hasattr(p, "panels") for p in products)  # type: ignore[attr-defined]
    step.products = (outs, downs, last)  # type: ignore[attr-defined]
    return step


def _with_kernels(text: Any, layers: list[Any], head: Any, fused: list[_Fused | None],
                  eager: Any) -> Step | None:
    """The step with the small operations between its products in the engine's C kernels
    too (:func:`engine.models.decode_kernels.ops`: the residual add with the next RMS norm,
    the rotary embedding of q and k, SiLU(gate) * up), where every product of ``eager``
    runs through the linear kernel (float32 weights, so float32 hidden states) and the
    layers are the plain SiLU decoder with one RMS epsilon; None elsewhere. A step whose
    rotary tables are not one ``(rows, dim)`` table each (none known) runs ``eager``."""
    import torch

    from engine.models import lean_compile

    lib = decode_kernels.ops()
    # (the compiled step's conditions: every layer fused and alike, one RMS epsilon, SiLU)
    if lib is None or eager.kernel_products != 4 * len(layers) + 1 or \
            lean_compile.eligible(text, layers, fused, head, kernels=True) is not None:
        return None
    eps_value = float(layers[0].input_layernorm.variance_epsilon)
    embed, rotary = text.embed_tokens, rope_table.RopeTable(text.rotary_emb)
    dim = layers[0].self_attn.head_dim
    heads, kv_heads = fused[0].splits[0] // dim, fused[0].splits[1] // dim
    outs, downs, last = eager.products
    before = [layer.input_layernorm.weight.detach() for layer in layers]
    after = [layer.post_attention_layernorm.weight.detach() for layer in layers]
    final = text.norm.weight.detach()
    qk = heads * dim + kv_heads * dim
    # (an embedding the step may look up itself: a plain table, nothing scaled or renormed)
    table = embed.weight.detach() if type(embed) is torch.nn.Embedding and \
        embed.max_norm is None else None
    whole = decode_layers.build(
        lib, [(f._qkv, outs[i], f._gate_up, downs[i]) for i, f in enumerate(fused)],
        after, [*before[1:], final], heads, kv_heads, dim, eps_value,
        [dim ** -0.5 if layer.self_attn.scaling is None else float(layer.self_attn.scaling)
         for layer in layers], embed=table, norm_first=before[0], head=last)
    # (what the rotary embedding is given for its dtype and device: a step's hidden states')
    probe = torch.empty(1, 1, embed.weight.shape[-1], dtype=embed.weight.dtype)

    def step(ids: Any, mask: Any, positions: Any, cache: Any, whole: Any = whole) -> Any:
        rows = ids.shape[0]
        whole_step = getattr(whole, "step", None)
        if whole_step is not None:  # (the whole step in one call)
            cos, sin = rotary(probe, positions)
            if cos.numel() == rows * dim:
                logits = whole_step(ids, cos.reshape(rows, dim).contiguous(),
                                    sin.reshape(rows, dim).contiguous(), mask.bool(), cache)
                if logits is not False and logits is not None:
                    return logits
        h = embed.forward(ids)
        cos, sin = rotary(h, positions)
        if cos.numel() != rows * dim:
            return eager(ids, mask, positions, cache)
        h = h.reshape(rows, -1).contiguous()
        cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
        keep = mask.bool()
        x = torch.empty_like(h)
        decode_kernels.add_rms(lib, h, None, before[0], eps_value, x)
        if whole is not None:  # (the layers in one call: decode_layers)
            ran = whole(h, x, cos, sin, keep, cache)
            if ran:
                return last(x)
            if ran is None:  # failed part-way: h and x are no longer the step's
                return step(ids, mask, positions, cache, whole=None)
        frame = keep[:, None, None, :]  # what attention.mask gives a decode step
        for i, layer in enumerate(layers):
            attn, both = layer.self_attn, fused[i]
            qkv = both._qkv(x)
            q, k = decode_kernels.rotate_qk(lib, qkv, cos, sin, heads, kv_heads, dim)
            v = qkv[:, qk:].view(rows, kv_heads, 1, dim)
            k, v = cache.update(k, v, i)
            out, _ = attention.attention(attn, q, k, v, frame, scaling=attn.scaling)
            decode_kernels.add_rms(lib, h, outs[i](out.reshape(rows, -1)), after[i],
                                   eps_value, x)
            act = decode_kernels.silu_mul(lib, both._gate_up(x))
            decode_kernels.add_rms(lib, h, downs[i](act),
                                   before[i + 1] if i + 1 < len(layers) else final,
                                   eps_value, x)
        return last(x)

    step_at = getattr(whole, "step_at", None)

    def at(tokens: list[int], positions: list[int], form: int, keep: Any, columns: int,
           cache: Any) -> tuple[Any, list[int]] | bool | None:
        """The step for rows given as lists, without a tensor made for them: each row's last
        token, its rotary position (M-RoPE's: the text position plus the row's delta; ``form``
        3) and ``keep``, the rows' bool mask with the new column in its first ``columns``
        (the rest of its row unread); the whole step in one call
        (``decode_layers``' ``step_at``), its cos and sin gathered from the rotary table in
        it. ``(logits, each row's greedy token)``; False where that call does not take these
        (a table not yet filled that far, caches other than the last step's: run ``step``);
        None where it failed part-way (the caches as they were)."""
        if step_at is None:
            return False
        tables = rotary.filled(form, probe.dtype)
        if tables is None:
            return False
        rows = len(tokens)
        array = ctypes.c_int64 * rows
        best = array()
        logits = step_at(array(*tokens), array(*positions), tables[0], tables[1], keep,
                         columns, cache, best)
        if logits is False or logits is None:
            return logits
        return logits, list(best)

    step.kernel_products = eager.kernel_products  # type: ignore[attr-defined]
    step.eager = eager  # type: ignore[attr-defined]
    step.whole = whole  # type: ignore[attr-defined]
    step.at = at  # type: ignore[attr-defined]
    return step
