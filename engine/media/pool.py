"""The bounded thread pool that decodes media off the event loop.

Sized by ``APHRODITE_MEDIA_LOADING_THREAD_COUNT`` (read once, when first used). FFmpeg,
Pillow, OpenCV and GStreamer release the GIL while decoding, so several videos decode in
parallel.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from engine import envs

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def decode_executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=envs.APHRODITE_MEDIA_LOADING_THREAD_COUNT,
                                       thread_name_prefix="aphrodite-decode")
        return _pool
