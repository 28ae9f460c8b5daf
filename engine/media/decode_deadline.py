"""A decode's time budget inside the API server (``--decode-isolation thread``).

A decode worker process is stopped from outside when it runs past ``--decode-cpu-budget-s``
(:mod:`engine.media.isolation`). A decode on a thread of the API server cannot be: the video
and audio loops check the budget here between frames instead, so one hostile file costs at
most the budget plus one frame. The clock is the decode's wall-clock time (FFmpeg's own
threads do part of the work, so the calling thread's CPU time would undercount it); a still
image is bounded by its header estimates (:mod:`engine.media.image`), not by this.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from engine.errors import MediaDecodeError

_local = threading.local()


@contextlib.contextmanager
def budget(seconds: float, what: str) -> Iterator[None]:
    """Decodes on this thread inside the block may take ``seconds`` (0: no budget)."""
    before = getattr(_local, "deadline", None)
    _local.deadline = (time.monotonic() + seconds, seconds, what) if seconds > 0 else None
    try:
        yield
    finally:
        _local.deadline = before


def check() -> None:
    """Raise the item's 422 when this thread's decode is past its budget (called between
    frames by the video backends and the audio decoder)."""
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline[0]:
        _, seconds, what = deadline
        raise MediaDecodeError(
            f"decoding the {what} took more than its {seconds:g} s budget",
            hint="send shorter or smaller media (the limit is --decode-cpu-budget-s)",
            code="media_decode_cpu_budget")
