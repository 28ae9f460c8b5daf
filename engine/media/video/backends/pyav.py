"""PyAV backend, with the sampled-decode fast path.

Packets are fed in decode order. A packet whose frame is not sampled is sent with
``skip_frame = NONREF``: the decoder drops it if no other frame references it and decodes it
otherwise, so the frames returned are exactly those of a full decode, while non-reference
frames nobody asked for (most B-frames) cost nothing. Decoding stops after the last sampled
frame. Frame threading runs on ``threads`` threads (0 = FFmpeg's choice).
"""

from __future__ import annotations

import io
from typing import ClassVar

import numpy as np

from engine.media.video.backends.base import VideoBackend, rotate_for_display, stack
from engine.media.video.options import PyAVOptions
from engine.media.video.scan import ContainerScan


def to_rgb(frame) -> np.ndarray:  # noqa: ANN001 - av.VideoFrame
    """RGB24 as the ffmpeg CLI converts it (swscale, bicubic), display rotation applied."""
    rgb = frame.to_ndarray(format="rgb24", interpolation="BICUBIC")
    return rotate_for_display(rgb, getattr(frame, "rotation", 0))


class PyAVBackend(VideoBackend):
    name: ClassVar[str] = "pyav"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: PyAVOptions) -> np.ndarray:  # type: ignore[override]
        import av

        wanted = set(indices)
        got: dict[int, np.ndarray] = {}
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            ctx = stream.codec_context
            ctx.thread_type = "AUTO"
            ctx.thread_count = options.threads
            use_pts = options.skip_nonref and scan.has_pts and len(set(scan.pts)) == len(scan.pts)
            if use_pts:
                index_of = {p: i for i, p in enumerate(scan.pts)}
                wanted_pts = {scan.pts[i] for i in wanted}
                for packet in container.demux(stream):
                    if packet.size:
                        ctx.skip_frame = "DEFAULT" if packet.pts in wanted_pts else "NONREF"
                    else:
                        ctx.skip_frame = "DEFAULT"  # the flush packet: drain every frame
                    for frame in ctx.decode(packet if packet.size else None):
                        i = index_of.get(frame.pts)
                        if i in wanted:
                            got[i] = to_rgb(frame)
                    if len(got) == len(wanted):
                        break
            else:
                for i, frame in enumerate(container.decode(stream)):
                    if i in wanted:
                        got[i] = to_rgb(frame)
                        if len(got) == len(wanted):
                            break
        return stack([got[i] for i in indices if i in got], scan)


BACKEND = PyAVBackend()
