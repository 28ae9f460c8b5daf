"""OpenCV backend (FFmpeg underneath): grab every frame up to the last sampled one and convert
only the sampled ones. Reads from memory through OpenCV's stream-buffered capture API."""

from __future__ import annotations

import io
from typing import ClassVar

import cv2
import numpy as np

from engine.errors import MediaDecodeError, UnsupportedMediaError
from engine.media.video.backends.base import VideoBackend, check_frame_size, stack
from engine.media.video.options import OpenCVOptions
from engine.media.video.scan import ContainerScan

# OpenCV's own worker pool (used by cvtColor) busy-waits after each call and fights the decode
# pool for the cores; decoding, not colour conversion, is what needs them.
cv2.setNumThreads(1)


class OpenCVBackend(VideoBackend):
    name: ClassVar[str] = "opencv"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: OpenCVOptions) -> np.ndarray:  # type: ignore[override]
        # Orientation is applied by OpenCV itself (CAP_PROP_ORIENTATION_AUTO is on by default).
        # OpenCV reads through this object until release(): keep a reference to it till then.
        source = io.BytesIO(data)
        cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, [])
        if not cap.isOpened():
            raise MediaDecodeError("OpenCV could not open the video", code="video_corrupt")
        try:
            wanted = set(indices)
            frames: list[np.ndarray] = []
            for i in range(indices[-1] + 1 if indices else 0):
                if not cap.grab():
                    if i == 0:
                        raise UnsupportedMediaError(
                            f"OpenCV cannot decode this {scan.codec} video",
                            hint="pick the pyav or torchcodec video backend for it",
                            code="video_codec_unsupported")
                    break
                if i in wanted:
                    ok, bgr = cap.retrieve()
                    if not ok:
                        break
                    rows, cols = bgr.shape[:2]
                    if (cols, rows) != (scan.width, scan.height):  # OpenCV may rotate
                        check_frame_size(rows, cols, scan)
                    frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
            return stack(frames, scan)
        finally:
            cap.release()
            source.close()


BACKEND = OpenCVBackend()
