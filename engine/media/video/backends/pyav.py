"""PyAV backend, with the sampled-decode fast path.

Packets are fed in decode order. A packet whose frame is not sampled is sent with
``skip_frame = NONREF``: the decoder drops it if no other frame references it and decodes it
otherwise, so the frames returned are exactly those of a full decode, while non-reference
frames nobody asked for (most B-frames) cost nothing. Decoding stops after the last sampled
frame. Frame threading runs on ``threads`` threads (0 = FFmpeg's choice). Sampled frames are
converted to RGB (swscale, bicubic: what the ffmpeg CLI does) beside the decoder on a small
shared pool, straight into one preallocated output array.
"""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import numpy as np

from engine.media.video.backends.base import VideoBackend, rotate_for_display, stack
from engine.media.video.options import PyAVOptions
from engine.media.video.scan import ContainerScan

_convert_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="aphrodite-rgb")


def to_rgb(frame) -> np.ndarray:  # an av.VideoFrame
    """RGB24 as the ffmpeg CLI converts it, display rotation applied (a view when possible)."""
    rgb = frame.reformat(format="rgb24", interpolation="BICUBIC")
    plane = rgb.planes[0]
    rows = np.frombuffer(plane, dtype=np.uint8).reshape(plane.height, plane.line_size)
    image = rows[:, : plane.width * 3].reshape(plane.height, plane.width, 3)
    return rotate_for_display(image, getattr(frame, "rotation", 0))


class _Collector:
    """Converts sampled frames into one (T, H, W, 3) array, off the decoding thread."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.out: np.ndarray | None = None
        self.jobs: list[Future[None]] = []
        self.filled: set[int] = set()

    def add(self, slot: int, frame) -> None:
        if self.out is None:
            turns = round((getattr(frame, "rotation", 0) or 0) / 90) % 2
            h, w = (frame.width, frame.height) if turns else (frame.height, frame.width)
            self.out = np.empty((self.count, h, w, 3), dtype=np.uint8)
        self.filled.add(slot)
        self.jobs.append(_convert_pool.submit(self._convert, slot, frame))

    def _convert(self, slot: int, frame) -> None:
        self.out[slot] = to_rgb(frame)  # type: ignore[index]

    def result(self, scan: ContainerScan) -> np.ndarray:
        for job in self.jobs:
            job.result()
        if self.out is None:
            return stack([], scan)
        return self.out if len(self.filled) == self.count else self.out[sorted(self.filled)]


class PyAVBackend(VideoBackend):
    name: ClassVar[str] = "pyav"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: PyAVOptions) -> np.ndarray:  # type: ignore[override]
        import av

        slot_of = {index: slot for slot, index in enumerate(indices)}
        collector = _Collector(len(indices))
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            ctx = stream.codec_context
            ctx.thread_type = "FRAME"
            ctx.thread_count = options.threads
            use_pts = options.skip_nonref and scan.has_pts and len(set(scan.pts)) == len(scan.pts)
            if use_pts:
                index_of = {p: i for i, p in enumerate(scan.pts)}
                wanted_pts = {scan.pts[i] for i in indices}
                for packet in container.demux(stream):
                    if packet.size:
                        ctx.skip_frame = "DEFAULT" if packet.pts in wanted_pts else "NONREF"
                    else:
                        ctx.skip_frame = "DEFAULT"  # the flush packet: drain every frame
                    for frame in ctx.decode(packet if packet.size else None):
                        slot = slot_of.get(index_of.get(frame.pts, -1))
                        if slot is not None:
                            collector.add(slot, frame)
                    if len(collector.filled) == len(indices):
                        break
            else:
                for i, frame in enumerate(container.decode(stream)):
                    slot = slot_of.get(i)
                    if slot is not None:
                        collector.add(slot, frame)
                        if len(collector.filled) == len(indices):
                            break
            # Collect while the container (and the decoder's frame pool) is still open.
            return collector.result(scan)


BACKEND = PyAVBackend()
