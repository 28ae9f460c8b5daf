"""torchcodec backend: ``get_frames_at`` on a decoder built from the bytes.

``seek_mode="exact"`` scans the file for a frame-accurate index; ``"approximate"`` trusts the
container's metadata (faster to open, can be wrong on files whose headers lie).
torchcodec applies the container's rotation itself.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from torchcodec.decoders import VideoDecoder

from engine.errors import MediaDecodeError
from engine.media.video.backends.base import VideoBackend, stack
from engine.media.video.options import TorchCodecOptions
from engine.media.video.scan import ContainerScan


class TorchCodecBackend(VideoBackend):
    name: ClassVar[str] = "torchcodec"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: TorchCodecOptions) -> np.ndarray:  # type: ignore[override]
        try:
            decoder = VideoDecoder(data, dimension_order="NHWC",
                                   num_ffmpeg_threads=options.num_ffmpeg_threads,
                                   seek_mode=options.seek_mode)
            available = decoder.metadata.num_frames
            usable = [i for i in indices if available is None or i < available]
            if not usable:
                return stack([], scan)
            batch = decoder.get_frames_at(usable)
        except (RuntimeError, ValueError, IndexError):
            # torchcodec's messages name its C++ source lines; the client gets the outcome.
            raise MediaDecodeError("the video is truncated or corrupt: torchcodec could not "
                                   "decode the sampled frames", code="video_corrupt",
                                   hint="re-encode the video and send it again") from None
        return np.ascontiguousarray(batch.data.numpy())


BACKEND = TorchCodecBackend()
