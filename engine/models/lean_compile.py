"""The lean decode step (:mod:`engine.models.lean_decode`) with its work between attentions
compiled by ``torch.compile`` (inductor), per batch-size bucket (``--compile-decode``).

vLLM captures a CUDA graph per batch size and pads a step's rows up to the next captured
size; this does the same with compiled graphs on a CPU. A step of ``rows`` rows runs as the
smallest bucket (:data:`BUCKETS`) holding them, its rows padded (pad rows are independent
rows whose results are dropped): the embedding, the rotary tables, each layer's cache update
and attention (shapes that grow with the context) stay eager on the real rows; what lies
between two attentions (the output projection, residuals, RMS norms, the MLP, the next
layer's q/k/v product and rotation) is one compiled graph, the same for every layer of a
model (the weights are its arguments), plus a first one (before layer 0's attention) and a
last one (after the last layer's: the final norm and the head). Products over a weight
oneDNN packed (:mod:`engine.models.cpu_linear`) stay oneDNN's through a custom operator
(inductor's own lowering wants the packed weight as a graph constant), so the compiled graph
fuses only the small operations between products.

Compiling is never paid inside a request: :meth:`CompiledStep.start` compiles the buckets,
smallest first, on a background thread at start-up (on the decode steps' torch threads:
inductor writes its thread count into the kernels); until a step's bucket is compiled the
eager lean step runs it. A bucket whose compile fails stays eager (logged once). The sums
of the compiled graph may run in another order than eager's (inductor's reductions), so its
logits are bounded against the eager step's, not bit for bit (``tests/engine/
test_lean_compile.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: the row counts compiled (a step runs as the smallest holding its rows), as vLLM's CUDA
#: graph sizes start
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def buckets_for(max_rows: int) -> list[int]:
    """The buckets a batch of at most ``max_rows`` rows uses (the last holds ``max_rows``)."""
    out = [b for b in BUCKETS if b < max_rows]
    return [*out, next((b for b in BUCKETS if b >= max_rows), max_rows)]


def bucket_of(rows: int, buckets: list[int]) -> int | None:
    """The smallest of ``buckets`` holding ``rows`` (None: more rows than any)."""
    return next((b for b in buckets if b >= rows), None)


_OP: Any = None


def _onednn_op() -> Any:
    """``aphrodite::onednn_linear(x, blocked, bias)``: the product over a oneDNN-packed weight
    as an operator inductor calls as it is (registered once per process)."""
    global _OP
    if _OP is None:
        import torch

        # (the schema written out: this module's annotations are strings)
        @torch.library.custom_op("aphrodite::onednn_linear", mutates_args=(),
                                 schema="(Tensor x, Tensor blocked, Tensor? bias) -> Tensor")
        def onednn_linear(x: Any, blocked: Any, bias: Any) -> Any:
            return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), blocked, bias,
                                                              "none", [], "")

        @onednn_linear.register_fake
        def _(x: Any, blocked: Any, bias: Any) -> Any:
            return x.new_empty((*x.shape[:-1], blocked.shape[0]))

        _OP = onednn_linear
    return _OP


def _linear(x: Any, product: tuple[Any, Any, Any]) -> Any:
    """``F.linear`` by ``product`` ``(weight, blocked, bias)``: through the packed copy where
    there is one and the rows are as many as :func:`engine.models.cpu_linear.prepared` sends
    there (static: the rows are the bucket's)."""
    import torch.nn.functional as F

    from engine.models.cpu_linear import MIN_ROWS

    weight, blocked, bias = product
    if blocked is not None and x.shape[0] >= MIN_ROWS:
        return _onednn_op()(x, blocked, bias)
    return F.linear(x, weight, bias)


def _rms(weight: Any, eps: float, x: Any) -> Any:
    """:func:`engine.models.lean_decode._rms` over the norm's weight."""
    import torch

    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _segments(shape: dict[str, Any]) -> tuple[Callable, Callable, Callable]:
    """The three graphs' functions for a model of ``shape`` (its heads, widths and epsilon,
    constants of the graphs)."""
    import torch
    import torch.nn.functional as F

    from engine.models.rotary import rotate

    eps, dim, splits, width = shape["eps"], shape["dim"], shape["splits"], shape["width"]

    def pre(h: Any, cos: Any, sin: Any, norm: Any, qkv: tuple) -> tuple[Any, Any, Any]:
        rows = h.shape[0]
        q, k, v = _linear(_rms(norm, eps, h), qkv).split(splits, dim=-1)
        q = q.view(rows, 1, -1, dim).transpose(1, 2)
        k = k.view(rows, 1, -1, dim).transpose(1, 2)
        v = v.view(rows, 1, -1, dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def post(h: Any, out: Any, o: tuple, norm: Any, gate_up: tuple, down: tuple) -> Any:
        h = h + _linear(out, o)
        both = _linear(_rms(norm, eps, h), gate_up)
        return h + _linear(F.silu(both[..., :width]) * both[..., width:], down)

    def first(h: Any, cos: Any, sin: Any, norm: Any, qkv: tuple) -> tuple:
        return pre(h, cos, sin, norm, qkv)

    def middle(h: Any, out: Any, cos: Any, sin: Any, done: tuple, norm: Any,
               qkv: tuple) -> tuple:
        h = post(h, out, *done)
        return (h, *pre(h, cos, sin, norm, qkv))

    def last(h: Any, out: Any, done: tuple, final: Any, head: tuple) -> Any:
        h = post(h, out, *done)
        return _linear(_rms(final, eps, h)[:, -1, :], head)

    compile_ = torch.compile  # (one compiled function each: a graph per bucket)
    return (compile_(first, dynamic=False), compile_(middle, dynamic=False),
            compile_(last, dynamic=False))


def _plain(t: Any) -> Any:
    """A parameter as a plain tensor over the same memory (dynamo guards a plain tensor
    argument by its shape, not by which it is)."""
    return None if t is None else t.detach()


def _blocked(module: Any) -> Any:
    """The oneDNN-packed copy of a linear layer's weight, where it has one."""
    return module.__dict__.get("_onednn_blocked")


def eligible(text: Any, layers: list[Any], fused: list[Any], head: Any,
             kernels: bool = False) -> str | None:
    """Why the compiled step cannot run this model (None: it can): every layer fused over
    float weights and shaped alike (one graph serves them all), SiLU's MLP without a down
    projection bias, one RMS epsilon, a float32 head. ``kernels``: for the step of the
    engine's C kernels (:func:`engine.models.lean_decode._with_kernels`), whose products
    take int8 rows as well (each product's weights are the linear kernel's to check)."""
    import torch

    if any(f is None or (f.qkv_weights is None and not kernels) for f in fused):
        return "a layer's products are not fused float32 ones"
    if any((f.splits, f.width) != (fused[0].splits, fused[0].width) for f in fused):
        return "the layers' widths differ"
    norms = [text.norm, *(n for layer in layers for n in (layer.input_layernorm,
                                                          layer.post_attention_layernorm))]
    if len({getattr(n, "variance_epsilon", None) for n in norms}) != 1:
        return "the layers' RMS norms differ in epsilon"
    act = getattr(text.config, "hidden_act", None)
    if act != "silu":
        return f"the MLP's activation is {act!r}, not silu"
    for layer in layers:
        down, o = layer.mlp.down_proj, layer.self_attn.o_proj
        if not kernels and not all(isinstance(getattr(m, "weight", None), torch.Tensor) and
                                   m.weight.dtype == torch.float32 for m in (down, o)):
            return "a projection is not float32"
        if getattr(down, "bias", None) is not None:
            return "the MLP's down projection has a bias"
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or \
            head.weight.dtype != torch.float32:
        return "the head is not a float32 linear layer"
    return None


class CompiledStep:
    """The lean step (``eager``) with compiled buckets (see the module's text): callable as
    the step is; :meth:`start` compiles in the background, :meth:`wait` waits for it."""

    def __init__(self, text: Any, layers: list[Any], head: Any, fused: list[Any],
                 eager: Callable, max_rows: int, threads: int) -> None:
        import torch

        self.eager = eager
        self.buckets = buckets_for(max_rows)
        self.threads = threads
        #: the buckets compiled and ready; the error that stopped the compiles, if any
        self.ready: set[int] = set()
        self.error: str | None = None
        #: whether steps may use the compiled buckets (a benchmark switches it to compare)
        self.enabled = True
        self._embed, self._rotary = text.embed_tokens, text.rotary_emb
        self._attention = [layer.self_attn for layer in layers]
        first_attn = layers[0].self_attn
        self._hidden = text.config.hidden_size
        self._dim = first_attn.head_dim
        self._heads = fused[0].splits[0] // self._dim
        self._scaling = [layer.self_attn.scaling for layer in layers]
        shape = dict(eps=float(layers[0].input_layernorm.variance_epsilon), dim=self._dim,
                     splits=list(fused[0].splits), width=fused[0].width)
        self._first, self._middle, self._last = _segments(shape)
        self._pre = [(_plain(layer.input_layernorm.weight),
                      (_plain(f.qkv_weights), f.qkv_blocked, _plain(f.qkv_bias)))
                     for layer, f in zip(layers, fused, strict=True)]
        self._post = [((_plain(layer.self_attn.o_proj.weight), _blocked(layer.self_attn.o_proj),
                        _plain(layer.self_attn.o_proj.bias)),
                       _plain(layer.post_attention_layernorm.weight),
                       (_plain(f.gate_up_weights), f.gate_up_blocked, None),
                       (_plain(layer.mlp.down_proj.weight), _blocked(layer.mlp.down_proj), None))
                      for layer, f in zip(layers, fused, strict=True)]
        self._final = _plain(text.norm.weight)
        self._head = (_plain(head.weight), _blocked(head), _plain(getattr(head, "bias", None)))
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        limit = len(self.buckets) + 4  # (a graph per bucket for each function)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), limit))

    # -- the step -----------------------------------------------------------------------
    def __call__(self, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        rows = ids.shape[0]
        bucket = bucket_of(rows, self.buckets)
        if not self.enabled or bucket not in self.ready:
            return self.eager(ids, mask, positions, cache)
        return self._compiled(bucket, ids, mask, positions, cache)

    def _compiled(self, bucket: int, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        import torch.nn.functional as F

        from engine.models import attention

        rows, pad = ids.shape[0], bucket - ids.shape[0]
        h = self._embed.forward(ids)
        cos, sin = self._rotary(h, positions)
        h, cos, sin = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (h, cos, sin))
        # (contiguous, as the compiles' inputs were: a graph is guarded on its strides)
        cos, sin = cos.unsqueeze(1).contiguous(), sin.unsqueeze(1).contiguous()
        frame = mask.bool()[:, None, None, :]  # what attention.mask gives a decode step
        q, k, v = self._first(h, cos, sin, *self._pre[0])
        last = len(self._attention) - 1
        for i, attn in enumerate(self._attention):
            k, v = cache.update(k[:rows], v[:rows], i)
            out, _ = attention.attention(attn, q[:rows], k, v, frame, scaling=self._scaling[i])
            out = F.pad(out.reshape(rows, 1, -1), (0, 0, 0, 0, 0, pad)).contiguous()
            if i == last:
                return self._last(h, out, self._post[i], self._final, self._head)[:rows]
            h, q, k, v = self._middle(h, out, cos, sin, self._post[i], *self._pre[i + 1])
        raise AssertionError("a model without layers")  # (for_model refuses one)

    # -- compiling ------------------------------------------------------------------------
    def start(self) -> None:
        """Compile every bucket, smallest first, on a background thread."""
        self._thread = threading.Thread(target=self._compile_all, name="aphrodite-compile",
                                        daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the compiles ended (all ready, or one failed); whether they did."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """No further bucket is compiled (one under way ends first, in the background)."""
        self._stop.set()

    def compile_bucket(self, bucket: int) -> None:
        """Compile ``bucket``'s graphs by running them once on zero inputs (the same dtypes and
        grad mode as a step), then mark it ready."""
        import torch

        weight = self._pre[0][0]
        with torch.inference_mode():  # (inputs made in it too: guards see inference tensors)
            h = weight.new_zeros((bucket, 1, self._hidden))
            # (cos and sin two tensors, as in a step: dynamo guards on which inputs alias)
            cos, sin = (weight.new_zeros((bucket, 1, 1, self._dim)) for _ in range(2))
            out = weight.new_zeros((bucket, 1, self._heads * self._dim))
            self._first(h, cos, sin, *self._pre[0])
            if len(self._post) > 1:
                self._middle(h, out, cos, sin, self._post[0], *self._pre[1])
            self._last(h, out, self._post[-1], self._final, self._head)
        self.ready.add(bucket)

    def _compile_all(self) -> None:
        from engine.cpus import use_torch_threads

        use_torch_threads(self.threads)
        try:
            for bucket in self.buckets:
                if self._stop.is_set():
                    return
                self.compile_bucket(bucket)
                logger.info("decode step compiled for %d rows", bucket)
        except Exception as exc:  # any compile error: the eager step keeps running
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.warning("--compile-decode: compiling the decode step failed (%s); the eager "
                           "step runs the buckets not compiled", self.error)
        finally:
            self._done.set()
