"""PyAV backend, with the sampled-decode fast path.

Packets are fed in decode order. A packet whose frame is not sampled is sent with
``skip_frame = NONREF``: the decoder drops it if no other frame references it and decodes it
otherwise, so the frames returned are exactly those of a full decode, while non-reference
frames nobody asked for (most B-frames) cost nothing. Decoding of a stretch stops after its
last sampled frame.

Closed GOPs are independent: when the clip has several keyframes, no leading pictures (open
GOPs) and no edit list, the GOPs that hold sampled frames are decoded in parallel, one decoder
each (the reference chain inside a GOP is serial; across GOPs it is not). Otherwise one decoder
runs with frame threading on ``threads`` threads (0 = FFmpeg's choice; in GOP-parallel mode
0 means one thread per GOP decoder, since the GOPs already fill the cores).

Sampled frames are converted to RGB (swscale, bicubic: what the ffmpeg CLI does; a filter graph
for sources above 8 bits) beside the decoders, straight into one preallocated output array.
"""

from __future__ import annotations

import bisect
import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import av
import numpy as np

from engine.media import frame_memory
from engine.media.video.backends.base import (
    VideoBackend,
    check_frame_size,
    rotate_for_display,
    stack,
)
from engine.media.video.options import PyAVOptions
from engine.media.video.scan import ContainerScan

_convert_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="aphrodite-rgb")
_gop_pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="aphrodite-gop")


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
    """Converts sampled frames into one (T, H, W, 3) array, off the decoding threads."""

    def __init__(self, count: int, stream, scan: ContainerScan) -> None:
        height, width = scan.height, scan.width
        self.scan = scan
        self.count = count
        self.stream = stream  # an av.VideoStream
        # Allocated here, in the calling thread: glibc serves a large block requested from a
        # worker thread with a fresh mmap every time (its per-thread arenas are too small),
        # and faulting in 200 MB of new pages per request costs more than a third of a decode.
        self.out: np.ndarray | None = (frame_memory.empty((count, height, width, 3))
                                       if count else None)
        self.graph: _GraphConverter | None = None
        self.jobs: list[Future[None]] = []
        self.filled: set[int] = set()
        self.lock = threading.Lock()

    def add(self, slot: int, frame) -> None:
        check_frame_size(frame.width, frame.height, self.scan)
        with self.lock:
            turns = round((getattr(frame, "rotation", 0) or 0) / 90) % 2
            h, w = (frame.width, frame.height) if turns else (frame.height, frame.width)
            if self.out is None or self.out.shape[1:3] != (h, w):  # rotated: other shape
                self.out = frame_memory.empty((self.count, h, w, 3))
            self.filled.add(slot)
            if _is_8bit(frame):
                self.jobs.append(_convert_pool.submit(self._convert, slot, frame))
            else:  # a filter graph is not thread-safe: convert here, under the lock
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


def _decode_stretch(data: bytes, scan: ContainerScan, wanted: dict[int, int],
                    collector: _Collector, threads: int, start_pts: int | None = None,
                    end_pts: int | None = None) -> None:
    """Decode from the keyframe at ``start_pts`` (or the start) until every pts in ``wanted``
    (pts -> output slot) came out or the keyframe at ``end_pts`` is reached."""
    remaining = set(wanted)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        ctx = stream.codec_context
        ctx.thread_type = "FRAME"
        ctx.thread_count = threads
        if start_pts is not None:
            container.seek(start_pts, stream=stream, backward=True, any_frame=False)
        for packet in container.demux(stream):
            if packet.size and end_pts is not None and packet.is_keyframe and \
                    packet.pts is not None and packet.pts >= end_pts:
                packet = None  # the next GOP: drain what is in flight instead
            if packet is not None and packet.size:
                ctx.skip_frame = "DEFAULT" if packet.pts in remaining else "NONREF"
            else:
                ctx.skip_frame = "DEFAULT"
            for frame in ctx.decode(packet if packet is not None and packet.size else None):
                if frame.pts in remaining:
                    remaining.discard(frame.pts)
                    collector.add(wanted[frame.pts], frame)
            if not remaining or packet is None or not packet.size:
                break


class PyAVBackend(VideoBackend):
    name: ClassVar[str] = "pyav"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: PyAVOptions) -> np.ndarray:  # type: ignore[override]
        use_pts = options.skip_nonref and scan.has_pts and len(set(scan.pts)) == len(scan.pts)
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            collector = _Collector(len(indices), stream, scan)
            if not use_pts:
                stream.codec_context.thread_type = "FRAME"
                stream.codec_context.thread_count = options.threads
                slot_of = {index: slot for slot, index in enumerate(indices)}
                for i, frame in enumerate(container.decode(stream)):
                    if i in slot_of:
                        collector.add(slot_of[i], frame)
                        if len(collector.filled) == len(indices):
                            break
                return collector.result(scan)
            wanted = {scan.pts[i]: slot for slot, i in enumerate(indices)}
            gops = self._gops(scan, wanted)
            if len(gops) < 2:
                _decode_stretch(data, scan, wanted, collector, options.threads)
            else:
                # One thread per GOP decoder (GOPs already fill the cores; more threads per
                # decoder oversubscribe them); an explicit `threads` goes to the biggest GOP.
                biggest = max(range(len(gops)), key=lambda g: gops[g][3])
                big_threads = options.threads or 1
                order = [biggest] + [g for g in range(len(gops)) if g != biggest]
                jobs = [_gop_pool.submit(_decode_stretch, data, scan, gops[g][2], collector,
                                         big_threads if g == biggest else 1,
                                         gops[g][0], gops[g][1]) for g in order]
                for job in jobs:
                    job.result()
            # Collect while the container (and the decoders' frame pools) are still open.
            return collector.result(scan)

    @staticmethod
    def _gops(scan: ContainerScan, wanted: dict[int, int]
              ) -> list[tuple[int, int | None, dict[int, int], int]]:
        """Independent GOPs holding sampled frames: (keyframe pts, next keyframe pts, wanted,
        frames to decode). Empty when the GOPs are not safely independent."""
        keys = sorted(scan.keyframe_pts)
        if scan.open_gop or scan.discarded or len(keys) < 2 or keys[0] != scan.pts[0]:
            return []
        parts: dict[int, dict[int, int]] = {}
        for pts, slot in wanted.items():
            k = bisect.bisect_right(keys, pts) - 1
            parts.setdefault(k, {})[pts] = slot
        # Work per GOP: frames from its keyframe to its last sampled frame.
        return [(keys[k], keys[k + 1] if k + 1 < len(keys) else None, part,
                 bisect.bisect_right(scan.pts, max(part)) - bisect.bisect_left(scan.pts, keys[k]))
                for k, part in sorted(parts.items())]


BACKEND = PyAVBackend()
