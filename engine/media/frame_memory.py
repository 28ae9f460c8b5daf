"""Where decoded media arrays live: ordinary memory, or shared memory inside a decode worker.

Backends allocate their output with :func:`empty`. In an API server (or offline) that is
``np.empty``. A decode worker installs a :class:`SharedAllocator`, so the frames are decoded
straight into a file under ``/dev/shm``; the API server maps the same file (:func:`attach`)
and removes its name at once: no copy on either side, and the memory goes when the last array
over it goes. Segment names carry the server's and the worker's pid, so a killed worker's
segments can be removed (:func:`remove_segments`).

When ``/dev/shm`` cannot hold a segment (a container started with a small ``--shm-size``)
allocation falls back to ordinary memory and the worker sends the bytes through its pipe.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger("aphrodite.media")

SHM_DIR = Path("/dev/shm")
PREFIX = "aphrodite-media-"

Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
_allocator: Allocator | None = None


def empty(shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
    """An uninitialised array where this process keeps decoded media."""
    if _allocator is not None:
        return _allocator(tuple(int(d) for d in shape), np.dtype(dtype))
    return np.empty(shape, dtype=dtype)


def install(allocator: Allocator | None) -> None:
    """Route :func:`empty` through ``allocator`` (a decode worker does this once)."""
    global _allocator
    _allocator = allocator


def _map(path: Path, size: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first write
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


class SharedAllocator:
    """Allocates each array in its own ``/dev/shm`` segment, remembering them by address."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.count = 0
        self.segments: dict[int, tuple[Path, int]] = {}  # data address -> (path, size)
        self.warned = False

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = max(math.prod(shape) * dtype.itemsize, 1)
        self.count += 1
        path = SHM_DIR / f"{PREFIX}{self.tag}-{self.count}"
        try:
            memory = _map(path, size, create=True)
        except OSError as exc:
            path.unlink(missing_ok=True)
            if exc.errno == errno.ENOMEM:  # this process's own memory limit, not /dev/shm
                raise MemoryError(f"no room to map {size} bytes") from None
            if not self.warned:
                self.warned = True
                logger.warning("shared memory unavailable (%s): decoded media goes through a "
                               "pipe, which is slower; give the container more /dev/shm "
                               "(docker run --shm-size)", exc.strerror)
            return np.empty(shape, dtype=dtype)
        array = np.frombuffer(memory, dtype=dtype, count=math.prod(shape)).reshape(shape)
        self.segments[array.__array_interface__["data"][0]] = (path, size)
        return array

    def export(self, array: np.ndarray) -> tuple[str, int] | None:
        """The segment holding exactly ``array`` (then the caller hands it over), or None."""
        found = self.segments.get(array.__array_interface__["data"][0])
        if found is None or not array.flags.c_contiguous or array.nbytes > found[1]:
            return None
        return found[0].name, found[1]

    def discard(self, keep: str | None = None) -> None:
        """Forget this decode's segments, removing all but ``keep`` (handed to the server)."""
        for path, _ in self.segments.values():
            if path.name != keep:
                path.unlink(missing_ok=True)
        self.segments.clear()


def share(array: np.ndarray, tag: str) -> tuple[str, int] | None:
    """A copy of ``array`` in a new segment named with ``tag`` (the caller's pid first, for
    :func:`remove_orphans`), for another process to :func:`attach`: its name and size, or None
    when ``/dev/shm`` has no room (then the caller sends the bytes another way)."""
    size = max(array.nbytes, 1)
    path = SHM_DIR / f"{PREFIX}{tag}"
    try:
        memory = _map(path, size, create=True)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    with memory:
        np.frombuffer(memory, dtype=array.dtype, count=array.size).reshape(array.shape)[...] = \
            array
    return path.name, size


def attach(name: str, size: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Map a segment a worker handed over and remove its name; the array owns the memory."""
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a media segment name: {name!r}")
    path = SHM_DIR / name
    try:
        memory = _map(path, size, create=False)
    finally:
        path.unlink(missing_ok=True)
    return np.frombuffer(memory, dtype=np.dtype(dtype), count=math.prod(shape)).reshape(shape)


def remove_segments(tag_prefix: str) -> int:
    """Remove segments whose tag starts with ``tag_prefix`` (a killed worker's, a dead
    server's); returns how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}{tag_prefix}*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def owner_pid(name: str) -> int | None:
    """The server process a segment belongs to (its name's first pid), or None."""
    owner = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
    return int(owner) if owner.isdigit() else None


def remove_orphans() -> int:
    """Remove segments left by server processes that no longer exist."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        owner = owner_pid(path.name)
        if owner is not None and not Path(f"/proc/{owner}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed
