"""Linear layers on the CPU through oneDNN, with weights packed once at load.

PyTorch's ``nn.Linear`` on a CPU calls MKL's sgemm for float32. On an AMD EPYC (these
machines) that is MKL's generic path, about 90 GFLOPS on one core, while oneDNN's matrix
product over a weight packed in its own blocked layout reaches about 240 GFLOPS for the shapes
of a prefill (hundreds to thousands of rows) and about 140 for a decode step of 8 rows,
with float32 results (``scripts/cpu_linear_bench.py`` measures both on the machine at hand).
A oneDNN call also costs about 25 us more than PyTorch's own, whatever its size: layers whose
weight has fewer than ``APHRODITE_CPU_ONEDNN_MIN_WEIGHT`` elements (512 K by default) stay on
PyTorch's path. On the tiny test models (weights of 2 K-57 K elements) every layer was slower
through oneDNN, 1.9-6x for a decode step of 8 rows; from 512 x 1024 up it was 1.4-1.6x faster
at 8 rows, and at hundreds of rows within 10% either way, except the 640 x 1710 vision MLP
(1.7x faster).
vLLM's CPU backend packs its linear weights with oneDNN the same way; this is most of why its
encoder and prefill cost half of ours on the same core before this module.
What it buys depends on the CPU: on a Zen 3 EPYC with AVX2 only (no AVX-512), measured on
2026-12-03 with one thread, oneDNN ran the prefill shapes at 75-83 GFLOPS and MKL at 42-96
(erratic from one shape and run to the next), and a small (43 M) model's image prompt took
576 ms with nothing packed against 588 ms as loaded (a video prompt 1923 against 1913), while
8-row decode products stayed 1.3-1.4x faster through oneDNN. Run the bench on the machine at
hand before changing the defaults.

:func:`pack_linears` packs every float32 ``nn.Linear`` of a model on the CPU (its ``forward``
becomes an instance attribute, so hooks still run) through torch's own oneDNN operators
(``torch.ops.mkldnn``: no new dependency). The plain weight stays (tied weights, such as an
output head that is the embedding table, and other readers of ``.weight`` keep working): the
packed copy doubles those layers' memory, which is why ``APHRODITE_CPU_ONEDNN_LINEAR=0``
turns it off. Inputs of fewer than :data:`MIN_ROWS` rows (a lone decode row: oneDNN is
slower there), of another dtype, or that need gradients take the plain path.
"""

from __future__ import annotations

from typing import Any

from engine import envs

#: fewer rows than this go through ``F.linear`` (one decode row is faster there)
MIN_ROWS = 4


def available() -> bool:
    """Whether this torch build has oneDNN on this CPU."""
    import torch

    return bool(torch.backends.mkldnn.is_available())


def pack_linears(model: Any, min_weight: int | None = None) -> int:
    """Pack ``model``'s float32 CPU linear layers of at least ``min_weight`` weight elements
    (``None``: ``APHRODITE_CPU_ONEDNN_MIN_WEIGHT``) for oneDNN (see the module's text); how
    many were packed (0 when turned off or unavailable)."""
    import torch

    if not envs.APHRODITE_CPU_ONEDNN_LINEAR or not available():
        return 0
    smallest = envs.APHRODITE_CPU_ONEDNN_MIN_WEIGHT if min_weight is None else min_weight
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and weight is not None and \
                weight.dtype == torch.float32 and weight.device.type == "cpu" and \
                weight.numel() >= smallest:
            module.forward = _packed_forward(module)
            packed += 1
    return packed


def linear(owner: Any, x: Any, weight: Any, bias: Any) -> Any:
    """``F.linear(x, weight, bias)``, through a oneDNN copy of ``weight`` packed on first use
    and kept on ``owner`` (a module whose weight this is, e.g. a patch embedding's flattened
    kernel), when packing is on and ``x`` and ``weight`` qualify (see the module's text)."""
    import torch
    import torch.nn.functional as F

    if x.dtype != torch.float32 or weight.device.type != "cpu" or x.numel() < MIN_ROWS * \
            x.shape[-1] or torch.is_grad_enabled() or not envs.APHRODITE_CPU_ONEDNN_LINEAR or \
            weight.numel() < envs.APHRODITE_CPU_ONEDNN_MIN_WEIGHT or not available():
        return F.linear(x, weight, bias)
    key = (weight.data_ptr(), tuple(weight.shape))
    packed = owner.__dict__.get("_onednn_packed")
    if packed is None or packed[0] != key:
        with torch.no_grad():
            packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                   None))
        owner.__dict__["_onednn_packed"] = packed
    return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), packed[1], bias, "none",
                                                      [], "")


def prepared(weight: Any, bias: Any) -> Any:
    """``x -> F.linear(x, weight, bias)`` for inference, with ``weight`` packed for oneDNN now
    where :func:`pack_linears` would pack it (inputs of :data:`MIN_ROWS` rows or more then go
    through the packed copy): what is decided here is not asked again per call."""
    import torch
    import torch.nn.functional as F

    if not envs.APHRODITE_CPU_ONEDNN_LINEAR or not available() or \
            weight.dtype != torch.float32 or weight.device.type != "cpu" or \
            weight.numel() < envs.APHRODITE_CPU_ONEDNN_MIN_WEIGHT:
        return lambda x: F.linear(x, weight, bias)
    with torch.no_grad():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    packed_product = torch.ops.mkldnn._linear_pointwise.default

    def product(x: Any) -> Any:
        if x.numel() < MIN_ROWS * x.shape[-1]:
            return F.linear(x, weight, bias)
        return packed_product(x.contiguous(), blocked, bias, "none", [], "")

    product.blocked = blocked  # type: ignore[attr-defined]  # (the compiled step's operand)
    return product


def _packed_forward(module: Any) -> Any:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        blocked = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
    module.__dict__["_onednn_blocked"] = blocked  # (engine.models.lean_compile's operand)

    def forward(x: Any) -> Any:
        if x.dtype != torch.float32 or x.numel() < MIN_ROWS * x.shape[-1] or (
                torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)):
            return F.linear(x, module.weight, module.bias)
        # the overload itself: calling the packet resolves the overload from the arguments
        return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), blocked, module.bias,
                                                          "none", [], "")

    return forward
