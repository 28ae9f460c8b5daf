"""Where decoded media arrays live: ordinary memory, or shared memory inside a decode worker.

Backends allocate their output with :func:`empty`. In an API server (or offline) that is
``np.empty``. A decode worker installs a :class:`SharedAllocator`, so the frames are decoded
straight into a file under ``/dev/shm``; the API server maps the same file (:func:`attach`):
no copy on either side. When the last array over it goes, the server renames the segment to a
free one (``...-free``) that its worker decodes into next time instead of creating a new one:
a new segment costs the kernel's allocation and zeroing of every page (about 0.3 s for 32
1080p frames, half the decode), a recycled one only its mapping. Each worker keeps at most
:data:`KEEP_FREE` free segments. Segment names carry the server's and the worker's pid, so a
killed worker's segments can be removed (:func:`remove_segments`), and a dead server's by the
next one to start (:func:`remove_orphans`).

An API server that passes decoded media on to an engine process unchanged (``--engine vllm``)
hands the worker's segment over instead of copying it (:func:`hand_over`): renamed out of its
worker's names into the server's own inputs (``<server pid>-in-...``, as
:mod:`engine.server.process.shared_inputs` names its copies), the engine maps it and removes the
name;
the memory goes when both let go of it. It never returns to the worker: nobody writes into
it again while the server or the engine still reads it.

When ``/dev/shm`` cannot hold a segment (a container started with a small ``--shm-size``)
allocation falls back to ordinary memory and the worker sends the bytes through its pipe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger("aphrodite.media")

SHM_DIR = Path("/dev/shm")
PREFIX = "aphrodite-media-"
#: the suffix of a segment its server has let go of, ready for its worker to decode into
FREE = "-free"
#: free segments one decode worker keeps (more are removed): one decode's worth of memory
KEEP_FREE = 1

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

    def _free(self) -> list[tuple[Path, int]]:
        """This worker's free segments (its server let go of them), largest first."""
        found = []
        with os.scandir(SHM_DIR) as entries:
            for entry in entries:
                if entry.name.startswith(f"{PREFIX}{self.tag}-") and entry.name.endswith(FREE):
                    try:
                        found.append((Path(entry.path), entry.stat(follow_symlinks=False)
                                      .st_size))
                    except OSError:
                        continue
        return sorted(found, key=lambda f: -f[1])

    def _reuse(self, path: Path, size: int) -> mmap.mmap | None:
        """Map under ``path`` the smallest free segment that holds ``size`` bytes without
        wasting most of itself (mapping costs per page), or None."""
        for free, capacity in reversed(self._free()):
            if not size <= capacity <= max(4 * size, 1 << 20):
                continue
            try:
                free.rename(path)
            except OSError:
                continue  # removed meanwhile
            return _map(path, capacity, create=False)
        return None

    def trim_free(self) -> None:
        """Keep at most :data:`KEEP_FREE` free segments (the largest)."""
        for path, _ in self._free()[KEEP_FREE:]:
            path.unlink(missing_ok=True)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = max(math.prod(shape) * dtype.itemsize, 1)
        self.count += 1
        path = SHM_DIR / f"{PREFIX}{self.tag}-{self.count}"
        try:
            memory = self._reuse(path, size) or _map(path, size, create=True)
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
        self.segments[array.__array_interface__["data"][0]] = (path, len(memory))
        return array

    def export(self, array: np.ndarray) -> tuple[str, int] | None:
        """The segment holding exactly ``array`` (then the caller hands it over), or None."""
        found = self.segments.get(array.__array_interface__["data"][0])
        if found is None or not array.flags.c_contiguous or array.nbytes > found[1]:
            return None
        return found[0].name, found[1]

    def discard(self, keep: str | None = None) -> None:
        """Forget this decode's segments: all but ``keep`` (handed to the server) become
        free ones, of which at most :data:`KEEP_FREE` stay."""
        for path, _ in self.segments.values():
            if path.name != keep:
                try:
                    path.rename(path.with_name(path.name + FREE))
                except OSError:
                    path.unlink(missing_ok=True)
        self.segments.clear()
        self.trim_free()


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


def attach(name: str, size: int, shape: tuple[int, ...], dtype: str, *,
           recycle: bool = False) -> np.ndarray:
    """Map a segment another process handed over. Without ``recycle`` its name goes at once
    (the array owns the memory); with it the name stays while an array over it lives, then
    becomes a free segment for the worker that made it (:class:`SharedAllocator`)."""
    if "/" in name or not name.startswith(PREFIX) or name.endswith(FREE):
        raise ValueError(f"not a media segment name: {name!r}")
    path = SHM_DIR / name
    try:
        memory = _map(path, size, create=False)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    array = np.frombuffer(memory, dtype=np.dtype(dtype), count=math.prod(shape)).reshape(shape)
    if recycle:
        address = array.__array_interface__["data"][0]
        _recycled[address] = (path, size, weakref.ref(memory))
        weakref.finalize(memory, _let_go, path, address)
    else:
        path.unlink(missing_ok=True)
    return array


#: this process's arrays over a worker's segment (attached with ``recycle``): their data
#: address -> the segment's path and size and the mapping, until handed over or let go
_recycled: dict[int, tuple[Path, int, weakref.ref]] = {}


def _let_go(path: Path, address: int | None = None) -> None:
    """The last array over a worker's segment is gone: hand the segment back to it."""
    if address is not None and _recycled.get(address, (None,))[0] == path:
        _recycled.pop(address, None)
    # OSError: its worker was replaced (and its segments removed) meanwhile, or the segment
    # was handed over (hand_over)
    with contextlib.suppress(OSError):
        path.rename(path.with_name(path.name + FREE))


def _mapping(array: np.ndarray) -> object:
    """The object at the end of ``array``'s ``base`` chain (an mmap behind a memoryview)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return getattr(base, "obj", base)


def hand_over(array: np.ndarray, tag: str) -> tuple[str, int] | None:
    """The worker's segment that ``array`` (attached with ``recycle``) fills from its start,
    renamed with ``tag`` (as :func:`share` names a copy) for another process to
    :func:`attach`: its name and size; no copy. The segment leaves its worker for good (it
    is never let go to the worker again), so this process's arrays over it keep their
    pixels. None when ``array`` is not such an array (then :func:`share` copies it)."""
    address = array.__array_interface__["data"][0]
    found = _recycled.get(address)
    if found is None or not array.flags.c_contiguous or array.nbytes > found[1] or \
            _mapping(array) is not found[2]():  # (an address reused by another mapping)
        return None
    path, size, _ = found
    handed = path.with_name(f"{PREFIX}{tag}")
    try:
        path.rename(handed)
    except OSError:  # its worker was replaced meanwhile: the segment is gone
        return None
    _recycled.pop(address, None)
    return handed.name, size


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
