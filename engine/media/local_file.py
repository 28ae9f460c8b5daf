"""Read a file under ``--allowed-local-media-path`` without following any symlink.

The path is walked one component at a time from the allowed folder with ``O_NOFOLLOW``, so a
symlink anywhere below the folder (to ``/etc/passwd`` or to a sibling folder) is refused, and
``..`` never reaches this far (the policy refuses it). Only regular files are read, opened
non-blocking so a FIFO cannot hang the server, and the size cap is checked on the open file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from engine.errors import MediaFetchError, MediaPolicyError, MediaTooLargeError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _refuse_link(shown: str) -> MediaPolicyError:
    return MediaPolicyError(
        f"local media {shown!r} is or passes through a symbolic link, which is not followed",
        hint="copy the file itself under --allowed-local-media-path",
        code="media_local_symlink",
    )


def read_local_file(root: Path, parts: tuple[str, ...], max_bytes: int, modality: str) -> bytes:
    """Bytes of ``root/parts...``; every component must be a real directory/file, no links."""
    shown = "/".join(parts)
    fds: list[int] = []
    try:
        fds.append(os.open(root, _DIR_FLAGS))
        for name in parts[:-1]:
            try:
                fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fds[-1], name):
                    raise _refuse_link(shown) from None
                raise _missing(shown) from None
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
        except OSError as exc:
            if exc.errno == errno.ELOOP or _is_link(fds[-1], parts[-1]):
                raise _refuse_link(shown) from None
            raise _missing(shown) from None
        fds.append(fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaPolicyError(
                f"local media {shown!r} is not a regular file",
                hint="point the URL at a regular file under --allowed-local-media-path",
                code="media_local_not_regular",
            )
        if info.st_size > max_bytes:
            raise MediaTooLargeError(
                f"local {modality} {shown!r} is {info.st_size} bytes, over the "
                f"{max_bytes}-byte cap",
                hint=f"raise APHRODITE_MAX_{modality.upper()}_BYTES to accept it",
            )
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > max_bytes:  # the file grew after fstat
                raise MediaTooLargeError(
                    f"local {modality} {shown!r} is over the {max_bytes}-byte cap",
                    hint=f"raise APHRODITE_MAX_{modality.upper()}_BYTES to accept it",
                )
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _missing(shown: str) -> MediaFetchError:
    return MediaFetchError(
        f"local media {shown!r} was not found under the allowed local media folder",
        hint="check the file:// URL against --allowed-local-media-path",
        code="media_local_not_found",
    )
