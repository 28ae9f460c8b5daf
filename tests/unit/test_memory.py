"""engine.memory: glibc's heap numbers follow real allocations (the soak and /metrics tell a
leak from an allocator high-water mark with them)."""

from __future__ import annotations

import ctypes

import pytest

from engine.memory import heap_stats, rss_bytes, trim

pytestmark = pytest.mark.skipif(heap_stats() is None, reason="needs glibc >= 2.33")


def test_heap_in_use_rises_with_a_live_block_and_falls_when_it_is_freed():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = heap_stats()
    block = libc.malloc(64 << 20)
    assert block
    try:
        during = heap_stats()
        assert during["live"] - before["live"] >= 64 << 20
    finally:
        libc.free(block)
    after = heap_stats()
    assert during["live"] - after["live"] >= 64 << 20


def test_freed_memory_kept_by_the_heap_is_counted_free_and_trim_gives_it_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # Mid-sized blocks (below the mmap threshold) written so their pages are resident; a
    # block kept after them stops the freed ones merging into the heap's top (which glibc
    # would trim by itself).
    blocks = [libc.malloc(64 << 10) for _ in range(512)]
    fence = libc.malloc(64 << 10)
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    try:
        free_before = heap_stats()["free"]
        for block in blocks:
            libc.free(block)
        assert heap_stats()["free"] - free_before >= 30 << 20  # freed, still in the heap
        resident = rss_bytes()
        assert trim()
        assert resident - rss_bytes() >= 16 << 20  # its pages went back to the OS
    finally:
        libc.free(fence)
