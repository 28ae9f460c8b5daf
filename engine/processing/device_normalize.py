"""Pixel normalization deferred to the model's device (vLLM's ``--mm-device-do-normalize``).

For Qwen2-VL, Qwen2.5-VL and Qwen3-VL the HF processor can skip rescaling and normalizing
(``do_rescale=False, do_normalize=False``): its patches then stay uint8, a quarter of the
float32 bytes through the processor cache, the shared memory to the engine and the copy to
the GPU, and the processor's patching moves bytes instead of floats (16 frames of 320x240:
about 18 -> 9 ms). The engine normalizes them where the model runs, with the processor's own
``rescale_and_normalize`` and mean/std: the same float operations on the same values, so the
model sees bit-identical inputs (test_device_normalize). Their patches are flat
(channel, time, row, column) blocks, so a (patches, channels, rest, 1) view puts the channel
where the normalization expects it.

The rule the engine applies: a deferred key arriving as uint8 is normalized; floats are left
as they are (the server ran with ``--no-mm-device-do-normalize``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Normalizer = Callable[[Any], Any]


def _normalizer(part: Any) -> Normalizer:
    mean, std = part.image_mean, part.image_std
    factor = part.rescale_factor
    channels = len(mean) if isinstance(mean, list | tuple) else 1

    def normalize(pixels: Any) -> Any:
        import torch

        shape = pixels.shape
        view = pixels.reshape(shape[0], channels, -1, 1)
        out = part.rescale_and_normalize(view, True, factor, True, mean, std)
        return out.reshape(shape).to(torch.float32)

    return normalize


def normalizers(loaded: Any) -> dict[str, Normalizer]:
    """Tensor name -> its normalization, for the keys the family defers (none for others)."""
    out: dict[str, Normalizer] = {}
    for key, attr in loaded.spec.normalize_on_device.items():
        part = getattr(loaded.processor, attr, None)
        if part is not None and hasattr(part, "rescale_and_normalize"):
            out[key] = _normalizer(part)
    return out


def apply(mm: dict[str, Any], found: dict[str, Normalizer]) -> dict[str, Any]:
    """``mm`` with every deferred uint8 tensor normalized."""
    import torch

    return {k: found[k](v) if k in found and isinstance(v, torch.Tensor)
            and v.dtype == torch.uint8 else v for k, v in mm.items()}


def processor_kwargs() -> dict[str, bool]:
    """What the processor is told when normalization is deferred."""
    return {"do_rescale": False, "do_normalize": False}
