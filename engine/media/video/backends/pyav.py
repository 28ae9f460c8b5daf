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

import av
import numpy as np

from engine.media.video.backends.base import VideoBackend, rotate_for_display, stack
from engine.media.video.options import PyAVOptions
from engine.media.video.scan import ContainerScan

_convert_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="aphrodite-rgb")


def _is_8bit(frame) -> bool:  # an av.VideoFrame
    return all(c.bits <= 8 for c in frame.format.components)


class _GraphConverter:
    """RGB24 through a ``format=rgb24`` filter graph: for more than 8 bits per component, the
    CLI's auto-inserted scaler (with its dithering) is matched only this way."""

    def __init__(self, stream) -> None:  # an av.VideoStream
        self.graph = av.filter.Graph()
        source = self.graph.add_buffer(template=stream)
        fmt = self.graph.add("format", "rgb24")
        sink = self.graph.add("buffersink")
        source.link_to(fmt)
        fmt.link_to(sink)
        self.graph.configure()

    def __call__(self, frame):  # av.VideoFrame -> av.VideoFrame
        self.graph.push(frame)
        return self.graph.pull()


def to_rgb(frame, converter: _GraphConverter | None = None) -> np.ndarray:
    """RGB24 as the ffmpeg CLI converts it, display rotation applied (a view when possible)."""
    if converter is not None:
        rgb = converter(frame)
    else:
        rgb = frame.reformat(format="rgb24", interpolation="BICUBIC")
    plane = rgb.planes[0]
    rows = np.frombuffer(plane, dtype=np.uint8).reshape(plane.height, plane.line_size)
    image = rows[:, : plane.width * 3].reshape(plane.height, plane.width, 3)
    return rotate_for_display(image, getattr(frame, "rotation", 0))


class _Collector:
    """Converts sampled frames into one (T, H, W, 3) array, off the decoding thread."""

    def __init__(self, count: int, stream) -> None:  # an av.VideoStream
        self.count = count
        self.stream = stream
        self.graph: _GraphConverter | None = None
        self.out: np.ndarray | None = None
        self.jobs: list[Future[None]] = []
        self.filled: set[int] = set()

    def add(self, slot: int, frame) -> None:
        if self.out is None:
            turns = round((getattr(frame, "rotation", 0) or 0) / 90) % 2
            h, w = (frame.width, frame.height) if turns else (frame.height, frame.width)
            self.out = np.empty((self.count, h, w, 3), dtype=np.uint8)
        self.filled.add(slot)
        if _is_8bit(frame):
            self.jobs.append(_convert_pool.submit(self._convert, slot, frame))
        else:  # a filter graph is not thread-safe: convert here, in order
            if self.graph is None:
                self.graph = _GraphConverter(self.stream)
            self.out[slot] = to_rgb(frame, self.graph)

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


        slot_of = {index: slot for slot, index in enumerate(indices)}
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            collector = _Collector(len(indices), stream)
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
