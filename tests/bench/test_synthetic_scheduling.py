"""Encoding synthetic media leaves the calling thread's scheduling as it was: SVT-AV1 moves
the thread that opens it to real-time SCHED_FIFO 99 (as root), and a server started from that
thread afterwards inherited it (its busy engine then starved its own API server: /metrics
unanswered for seconds, requests never seen in flight)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from fractions import Fraction

import pytest

from tests.fixtures import synthetic

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux only")

CHILD = "import os; print(os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)"


def in_a_thread(encode) -> dict[str, tuple[int, int]]:
    """Run ``encode`` on a new thread (a normal-policy one, as the test's), then read that
    thread's policy and that of a process it starts."""
    seen: dict[str, tuple[int, int]] = {}

    def run() -> None:
        encode()
        seen["thread"] = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             check=True).stdout.split()
        seen["child"] = (int(out[0]), int(out[1]))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    return seen


def raw_av1_encode() -> None:
    """An SVT-AV1 encode without the guard (what PyAV does on its own)."""
    import av

    buf = io.BytesIO()
    out = av.open(buf, mode="w", format="mp4")
    stream = out.add_stream("libsvtav1", rate=Fraction(10))
    stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
    for i in range(3):
        frame = av.VideoFrame.from_ndarray(synthetic.video_frame(i, 64, 64), format="rgb24")
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
    out.close()


def test_an_av1_clip_leaves_the_thread_and_its_children_at_normal_priority():
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    seen = in_a_thread(lambda: synthetic.make_video(codec="libsvtav1", width=64, height=64,
                                                    fps=10, seconds=0.3))
    assert seen == {"thread": (os.SCHED_OTHER, 0), "child": (os.SCHED_OTHER, 0)}


def test_the_encoder_alone_raises_its_thread_to_real_time_where_it_may():
    """Why the guard is there: on a machine where SVT-AV1 may (root, as CI), its thread and
    every process it starts afterwards run at SCHED_FIFO 99."""
    seen = in_a_thread(raw_av1_encode)
    if seen["thread"] == (os.SCHED_OTHER, 0):
        pytest.skip("SVT-AV1 may not raise priorities here (not root)")
    assert seen == {"thread": (os.SCHED_FIFO, 99), "child": (os.SCHED_FIFO, 99)}
