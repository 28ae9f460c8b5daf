"""Allocator tuning for long-running media processes.

Decoded video is large (32 RGB 1080p frames are 200 MB). glibc serves blocks that large with a
fresh ``mmap`` each time and unmaps them on free, so every request pays page faults for memory
it just gave back. Raising the mmap and trim thresholds keeps freed frame memory in the heap for
the next request: resident memory settles at its peak instead of rising and falling, and
sampled decoding gets ~10% faster on the 1080p benchmark clip. Called by `serve` and the
benchmarks, never on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Apply the thresholds once per process; False where glibc's mallopt is unavailable."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False
