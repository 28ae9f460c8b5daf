"""Patch embeddings as matrix products.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed each vision patch with a ``Conv3d`` whose kernel equals
its stride, applied to inputs that are exactly one kernel each (the processor already cut the
pixels into flat patches). That convolution is a matrix product of the flat patches with the
flattened kernel, and torch's CPU convolution is about 4x slower than the product (3000 patches
into 32 channels: 12.4 -> 3.4 ms; into 1280 channels, Qwen2.5-VL-3B's width: 383 -> 92 ms).
vLLM makes the same substitution. The values differ from the convolution's by float rounding
only (relative 1.5e-6: the sums run in another order). On a CPU in float32 the product goes
through oneDNN with the kernel packed once (:func:`engine.models.cpu_linear.linear`).

:func:`convolutions_as_products` switches every such convolution of a model in place (its
class, not its weights: the state dict and every other input shape keep the convolution).
"""

from __future__ import annotations

import functools
from typing import Any

from engine.models import cpu_linear


def _one_patch(module: Any, x: Any) -> bool:
    dims = len(module.kernel_size)
    return x.dim() == dims + 2 and tuple(x.shape[2:]) == tuple(module.kernel_size)


def _product(module: Any, x: Any) -> Any:
    out = cpu_linear.linear(module, x.reshape(x.shape[0], -1),
                            module.weight.reshape(module.out_channels, -1), module.bias)
    return out.view(x.shape[0], module.out_channels, *([1] * len(module.kernel_size)))


@functools.cache
def _classes() -> dict[type, type]:
    import torch

    made: dict[type, type] = {}
    for base in (torch.nn.Conv2d, torch.nn.Conv3d):
        def forward(self: Any, x: Any, _base: type = base) -> Any:
            if _one_patch(self, x):
                return _product(self, x)
            return _base.forward(self, x)

        made[base] = type(f"Patch{base.__name__}", (base,), {
            "forward": forward,
            "__doc__": f"A {base.__name__} that embeds one-kernel inputs by a matrix product."})
    return made


def _eligible(module: Any) -> bool:
    return (all(k == s for k, s in zip(module.kernel_size, module.stride, strict=True))
            and not any(module.padding if isinstance(module.padding, tuple) else (1,))
            and all(d == 1 for d in module.dilation) and module.groups == 1
            and module.padding_mode == "zeros")


def convolutions_as_products(model: Any) -> int:
    """Switch ``model``'s patch-embedding convolutions (kernel = stride, no padding, dilation
    or groups) to the matrix product for one-kernel inputs; how many were switched."""
    switched = 0
    for module in model.modules():
        made = _classes().get(type(module))
        if made is not None and _eligible(module):
            module.__class__ = made
            switched += 1
    return switched
