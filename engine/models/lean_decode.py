"""A decode step of a plain pre-norm decoder (Qwen2, Qwen2-VL, Qwen2.5-VL, Llama text models)
run layer by layer with the model's own weights and the same operations in the same order as
its transformers code, without that code's machinery around them.

On a small model a decode step is mostly Python: each of transformers' modules goes through
``nn.Module.__call__``, its decorators (output capture, kwarg checks, config lookups), the
attention-function registry and a mask built column by column. Here the step calls the
layers' weights directly: the embedding, the model's own rotary embedding (M-RoPE included),
each layer's RMS norms, q/k/v projections, rotation, cache update, :func:`engine.models.
attention.attention` (what the model's attention calls), output projection and MLP, then the
final norm and the LM head. Logits equal the model's forward bit for bit (test_lean_decode); a
step of the tiny Qwen2.5-VL with 8 rows takes 1.5 ms instead of 2.1 ms.

Only the text models registered in :data:`DECODERS` (by their config's ``model_type``), on the
engine's attention (:mod:`engine.models.attention`), without sliding-window layers, on a CPU
device are run so; anything else (another family, eager or flash attention, a GPU: there a
step without padding runs SDPA without a mask, which this step would not match bit for bit,
``APHRODITE_LEAN_DECODE=0``) runs the model's forward. :func:`for_model` decides once, when
the runner starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import envs
from engine.models import attention, parts

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


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def for_model(model: Any) -> Step | None:
    """The lean decode step for ``model`` (``step(ids, mask, positions, cache)``: ids
    ``(rows, 1)``, the rows' 2-D padding mask over the cache plus the new column, positions as
    the model's forward takes them; the last logits, ``(rows, vocab)``), or None where the
    model's own forward must run."""
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
    return _step(text, layers, head)


def _step(text: Any, layers: list[Any], head: Any) -> Step:
    embed, rotary, final_norm = text.embed_tokens, text.rotary_emb, text.norm

    def step(ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        rows = ids.shape[0]
        h = embed.forward(ids)
        cos, sin = rotary(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        frame = mask.bool()[:, None, None, :]  # what attention.mask gives a decode step
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            dim = attn.head_dim
            x = _rms(layer.input_layernorm, h)
            q = attn.q_proj.forward(x).view(rows, 1, -1, dim).transpose(1, 2)
            k = attn.k_proj.forward(x).view(rows, 1, -1, dim).transpose(1, 2)
            v = attn.v_proj.forward(x).view(rows, 1, -1, dim).transpose(1, 2)
            k, v = cache.update(_rotate(k, cos, sin), v, i)
            out, _ = attention.attention(attn, _rotate(q, cos, sin), k, v, frame,
                                         scaling=attn.scaling)
            h = h + attn.o_proj.forward(out.reshape(rows, 1, -1).contiguous())
            x = _rms(layer.post_attention_layernorm, h)
            h = h + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x))
                                          * mlp.up_proj.forward(x))
        return head.forward(_rms(final_norm, h)[:, -1, :])

    return step
