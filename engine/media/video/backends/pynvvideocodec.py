"""NVIDIA NVDEC through PyNvVideoCodec (``SimpleDecoder``, RGB output on the GPU).

PyNvVideoCodec is imported only when this backend is chosen: on a machine without an NVIDIA
driver its import fails ("Failed to load NVENC library"), which becomes a clear error.
``hw_decoders`` decoder slots are kept per process (reserved when the server starts); a decode
waits for a free slot. The bytes reach the decoder through an in-memory file (memfd).
Frames come back to host memory as (T, H, W, 3) uint8; rotation is applied like the other
backends (read by PyAV from the first frame, as ``media probe`` reads it: torchcodec needs the
system's FFmpeg libraries, which a GPU image need not have).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, ClassVar

import numpy as np

from engine.errors import ConfigError, sanitize
from engine.media.video.backends.base import VideoBackend, rotate_for_display, stack
from engine.media.video.info import first_frame_rotation
from engine.media.video.options import PyNvVideoCodecOptions
from engine.media.video.scan import ContainerScan

logger = logging.getLogger(__name__)

_nvc: Any = None
_slots: queue.Queue[int] | None = None
_slot_count = 0
_lock = threading.Lock()


def load_pynvvideocodec() -> Any:
    """``import PyNvVideoCodec``, turning a missing driver or package into a ConfigError."""
    global _nvc
    with _lock:
        if _nvc is None:
            try:
                import PyNvVideoCodec as nvc
            except ImportError:
                raise ConfigError(
                    "the pynvvideocodec video backend needs the PyNvVideoCodec package",
                    hint="pip install 'aphrodite-toolkit[nvidia]' on a machine with an NVIDIA "
                         "GPU, or pick a CPU video backend", code="video_backend_unavailable",
                ) from None
            except RuntimeError as exc:
                raise ConfigError(
                    f"PyNvVideoCodec cannot use NVDEC here: {sanitize(exc)}",
                    hint="this backend needs an NVIDIA GPU and driver; pick opencv, pyav or "
                         "torchcodec on this machine", code="video_backend_unavailable",
                ) from None
            _nvc = nvc
        return _nvc


def reserve_slots(count: int) -> None:
    """Reserve ``count`` hardware decoder slots for this process (at server start)."""
    global _slots, _slot_count
    with _lock:
        if _slots is None:
            _slots = queue.Queue()
            for i in range(count):
                _slots.put(i)
            _slot_count = count


_fallback_reasons: set[str] = set()
#: FFmpeg threads of a stream decoded on the CPU instead of NVDEC
FALLBACK_THREADS = 2


def _is_nvdec_error(exc: BaseException) -> bool:
    """PyNvVideoCodec's own exceptions (``_PyNvVideoCodec.PyNvVCException`` and its
    ``...Unsupported``) are not RuntimeErrors; both kinds mean NVDEC could not decode this
    stream (codec, profile, bit depth, chroma format or size it has no decoder for)."""
    return isinstance(exc, RuntimeError) or type(exc).__module__.endswith("PyNvVideoCodec")


def cpu_reason(scan: ContainerScan) -> str | None:
    """Why a stream goes to pyav instead of NVDEC, decided from the scan before any decode;
    None when NVDEC takes it. Seen on an H200 (PyNvVideoCodec 2.2.4): on an open-GOP H.264
    stream NVDEC's output had shifted timestamps and the wrong picture at the second GOP's
    leading B-frames (frame 10 where 17 belongs), and on Matroska every frame after the
    fourth was the last one, whether read in order or by seeking."""
    if scan.open_gop:
        return "an open-GOP stream, where NVDEC returned wrong frames"
    if "matroska" in scan.container:
        return "a Matroska/WebM container, where NVDEC returned wrong frames"
    return None


class PyNvVideoCodecBackend(VideoBackend):
    name: ClassVar[str] = "pynvvideocodec"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: PyNvVideoCodecOptions) -> np.ndarray:  # type: ignore[override]
        nvc = load_pynvvideocodec()
        reserve_slots(options.hw_decoders)
        if not indices:
            return stack([], scan)
        if reason := cpu_reason(scan):
            return self._on_cpu(data, scan, indices, reason)
        import torch

        slot = _slots.get()  # type: ignore[union-attr]
        fd = os.memfd_create("aphrodite-nvdec", os.MFD_CLOEXEC)
        refused: str | None = None
        try:
            os.write(fd, data)
            decoder = nvc.SimpleDecoder(f"/proc/self/fd/{fd}", gpu_id=options.gpu_id,
                                        use_device_memory=True,
                                        output_color_type=nvc.OutputColorType.RGB)
            batch = decoder.get_batch_frames_by_index(list(indices))
            frames = [torch.from_dlpack(f).cpu().numpy() for f in batch]
        except Exception as exc:
            if not _is_nvdec_error(exc):
                raise
            refused = sanitize(exc)
        finally:
            os.close(fd)
            _slots.put(slot)  # type: ignore[union-attr]
        if refused is not None:  # on the CPU, the decoder slot given back first
            return self._on_cpu(data, scan, indices, refused)
        turn = first_frame_rotation(data)
        return stack([rotate_for_display(np.ascontiguousarray(f[..., :3]), turn)
                      for f in frames], scan)

    @staticmethod
    def _on_cpu(data: bytes, scan: ContainerScan, indices: list[int], reason: str
                ) -> np.ndarray:
        """A stream NVDEC gets wrong (``cpu_reason``) or has no decoder for (seen on an H200:
        AV1, H.264 4:4:4 and High 10, HEVC and VP9 at 160x120) decodes on the CPU with pyav,
        the reference backend, which also turns a truly corrupt stream into its client error.
        Logged once per reason."""
        from engine.media.video.backends import pyav
        from engine.media.video.options import PyAVOptions

        key = f"{scan.codec}: {reason.splitlines()[0] if reason else ''}"
        if key not in _fallback_reasons and len(_fallback_reasons) < 64:
            _fallback_reasons.add(key)
            logger.warning("NVDEC cannot decode a %s stream (%s): decoding it with pyav",
                           scan.codec, reason.replace("\n", " ")[:200])
        # two threads, not FFmpeg's choice (every core): a client choosing such streams
        # must not take the API server's CPUs from everyone else's requests
        return pyav.BACKEND.decode(data, scan, indices, PyAVOptions(threads=FALLBACK_THREADS))


BACKEND = PyNvVideoCodecBackend()
