"""Weight-only int8 linear layers (``--quantization int8``): each weight row (output channel)
stored as symmetric int8 with one float scale, dequantized in the product.

A decode step reads every weight once for a few rows: a quarter of float32's bytes is most of
the step on a CPU. The lean decode step multiplies by the engine's linear kernel over int8
panels where it is built (:func:`engine.models.decode_kernels.linear_int8`: float32
activations, the bytes read at the memory's speed); elsewhere, and for the model's own
forward, the product is PyTorch's own int8 weight-packed kernel,
``torch.ops.aten._weight_int8pack_mm`` (no new dependency), for inputs of at most
:data:`KERNEL_MAX_ROWS` rows; its CPU path is vectorised for bfloat16 activations only (with
float32 ones it ran 5-7x slower than a float32 product here), so activations go in as
bfloat16, and the scales are chosen exactly representable in bfloat16 (the kernel takes them
in the activations' type). Measured on this project's Xeon (AVX-512, one thread, in-cache
weights): 512 x 3072 at 1 row 0.095 ms against 0.24 ms float32 through oneDNN, at 4 rows
0.19 against 0.28, at 8 rows about the same, at 16 rows 1.4x slower (its time grows with the
rows: it does not reuse a weight across them). Larger inputs (prefills) are multiplied by the
weight converted to bfloat16 for the call (oneDNN's bfloat16 product, AMX where the CPU has
it): at 128 rows 2.5 ms against 5.5 float32. Where the kernel is missing the bfloat16 path
serves every input.

What it costs in quality is the rounding of each weight to 1/254 of its row's largest value
and of the activations and outputs to bfloat16: ``aphrodite bench decode-step --quantization
int8`` reports the greedy token agreement with float32 and the mean KL divergence of the
next-token distributions on a fixed prompt set, beside the step's time.

:func:`quantize_model` replaces every ``nn.Linear`` of the language model (the decoder
layers' projections; not the embedding or the output head, nor the vision or audio towers)
with an :class:`Int8Linear`; the float weights are freed.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models import parts

#: inputs of at most this many rows go through the int8 kernel, larger ones through a
#: bfloat16 copy of the weight made for the call (the kernel's time grows with the rows; the
#: two crossed between 8 and 16 rows here, see the module's text)
KERNEL_MAX_ROWS = 8
#: the largest magnitude of a quantized weight (symmetric: -127..127)
QMAX = 127


def kernel_available() -> bool:
    """Whether this torch build has the int8 weight-packed matmul."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out, in) as int8 rows and a float32 scale per row, ``weight ~= q * scale``:
    each scale is the row's largest magnitude over :data:`QMAX`, raised to the next value
    bfloat16 holds exactly (so the kernel's bfloat16 scales lose nothing), so every element
    is off by at most half its scale."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    # bfloat16 rounds to nearest within 2**-9: 1 + 2**-8 keeps the rounded scale >= amax / QMAX
    scale = (amax / QMAX * (1 + 2 ** -8)).to(torch.bfloat16).to(torch.float32)
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``q`` and ``scale`` stand for."""
    return q.to(torch.float32) * scale[:, None]


def product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scale), bias)`` in bfloat16 arithmetic, in ``x``'s dtype
    (``scale`` as :func:`quantize_rows` gives it)."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if flat.shape[0] <= KERNEL_MAX_ROWS and x.device.type == "cpu" and kernel_available():
        out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), q,
                                                 scale.to(torch.bfloat16))
    else:
        out = torch.nn.functional.linear(flat, q.to(torch.bfloat16)) * \
            scale.to(torch.bfloat16)
    out = out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
    return out if bias is None else out + bias


class Int8Linear(torch.nn.Module):
    """An ``nn.Linear`` with its weight as int8 rows and a scale per row (buffers ``qweight``
    and ``scale``); the bias, if any, stays as it was."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model(model: Any) -> int:
    """Replace the float ``nn.Linear`` layers of ``model``'s language model (the model itself
    for a text-only one, less its output head) with :class:`Int8Linear`; how many."""
    text = parts.language_model(model) or getattr(model, "model", None) or model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(owner, name, child) for owner in text.modules()
             for name, child in owner.named_children()
             if type(child) is torch.nn.Linear and child is not head and
             child.weight.dtype.is_floating_point]
    with torch.no_grad():
        for owner, name, child in swaps:
            setattr(owner, name, Int8Linear(child))
    return len(swaps)
