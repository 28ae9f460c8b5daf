"""Dataset files' own media paths (``{"path": ...}`` in a JSONL row or a trace line), read
from ``--media-dir`` and nowhere else: a path that leaves it (``../x``, an absolute path, a
symbolic link out) is refused, as the server refuses a local path outside
``--allowed-local-media-path``: a dataset from elsewhere must not upload this machine's files
to the target. The dataset files themselves are text read as UTF-8, errors named by file."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError

#: the largest media file a dataset row may name (a server's body cap is far smaller)
MAX_MEDIA_FILE_BYTES = 256 << 20


def read_media(media_dir: Path | None, name: object, where: str) -> bytes:
    """The bytes of ``name`` inside ``media_dir``; ``where`` names the row for errors."""
    if media_dir is None:
        raise ConfigError(f"{where} names a media path; pass --media-dir",
                          code="invalid_dataset")
    if not isinstance(name, str) or not name or "\0" in name:
        raise ConfigError(f"{where}: a media path is a non-empty string",
                          code="invalid_dataset")
    root = Path(media_dir).resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(root):
        raise ConfigError(f"{where}: the media path {name!r} is outside --media-dir {root}",
                          hint="name files inside --media-dir, relative to it",
                          code="invalid_dataset")
    try:
        if not target.is_file():
            raise ConfigError(f"{where}: the media path {name!r} is not a file in "
                              f"--media-dir {root}", code="invalid_dataset")
        if target.stat().st_size > MAX_MEDIA_FILE_BYTES:
            raise ConfigError(f"{where}: the media file {name!r} is over "
                              f"{MAX_MEDIA_FILE_BYTES >> 20} MB", code="invalid_dataset")
        return target.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the media file {name!r}: "
                          f"{exc.strerror or exc}", code="invalid_dataset") from None


def read_lines(path: Path, what: str) -> list[str]:
    """A dataset file's lines, as UTF-8 text; unreadable or not UTF-8: one line naming it."""
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}",
                          code="invalid_dataset") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the {what} {path} is not UTF-8 text (byte {exc.start})",
                          code="invalid_dataset") from None
