"""GPU utilisation, memory and NVDEC (video decoder) use over a phase, read through NVML
(``nvidia-ml-py``, imported as ``pynvml`` only when ``--metrics-interval`` asks for a series).

NVML sees every NVIDIA GPU of the machine ``bench serve`` runs on: the target's when it runs
there (``--embedded``, or a server on this host); a remote target's GPUs are not seen. No
``pynvml``, no driver or no GPU is not an error: the result says why
(``{"available": false, "reason": ...}``) and the run goes on. A reading a GPU does not
support (a MIG slice has no decoder utilisation) is ``None``.

One sample per GPU: ``gpu_util_pct`` and ``memory_util_pct`` (NVML's utilization rates: the
share of the last sample period a kernel ran / device memory was read or written),
``memory_used_bytes``, ``decoder_util_pct`` (NVDEC) and ``encoder_util_pct`` (NVENC).
"""

from __future__ import annotations

import contextlib
from typing import Any


class GpuSampler:
    """``open()`` once (returns None, or why NVML cannot be read), ``sample()`` per tick,
    ``close()`` at the end."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: list[Any] = []
        self.devices: list[dict[str, Any]] = []

    def open(self) -> str | None:
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py (pynvml) is not installed"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # no driver, no library: this machine has no GPU
            return f"NVML could not start ({exc})"
        self.nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            for index, handle in enumerate(self.handles):
                name = pynvml.nvmlDeviceGetName(handle)
                self.devices.append({
                    "index": index,
                    "name": name.decode(errors="replace") if isinstance(name, bytes) else name,
                    "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        except pynvml.NVMLError as exc:
            self.close()
            return f"NVML could not list the GPUs ({exc})"
        if not self.handles:
            self.close()
            return "NVML found no GPU"
        return None

    def _read(self, call: Any, handle: Any) -> Any:
        try:
            return call(handle)
        except self.nvml.NVMLError:  # not supported on this GPU (or it fell off the bus)
            return None

    def sample(self) -> list[dict[str, Any]]:
        """One reading per GPU (blocking calls of a few microseconds each)."""
        nvml, out = self.nvml, []
        for index, handle in enumerate(self.handles):
            rates = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            decoder = self._read(nvml.nvmlDeviceGetDecoderUtilization, handle)
            encoder = self._read(nvml.nvmlDeviceGetEncoderUtilization, handle)
            out.append({"index": index,
                        "gpu_util_pct": None if rates is None else float(rates.gpu),
                        "memory_util_pct": None if rates is None else float(rates.memory),
                        "memory_used_bytes": None if memory is None else int(memory.used),
                        # [utilization %, sampling period in microseconds]
                        "decoder_util_pct": None if decoder is None else float(decoder[0]),
                        "encoder_util_pct": None if encoder is None else float(encoder[0])})
        return out

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self.nvml = None
