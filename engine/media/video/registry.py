"""Registry of video backends: name -> module (from :data:`BACKENDS`), imported only when
that backend is chosen."""

from __future__ import annotations

import importlib
import threading

from engine.errors import ConfigError
from engine.media.video.backend_info import BACKENDS, NAMES
from engine.media.video.backends.base import VideoBackend

_loaded: dict[str, VideoBackend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> VideoBackend:
    """The backend called ``name``, importing its module on first use."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown video backend {name!r}; valid backends: "
                          f"{', '.join(NAMES)}", code="unknown_video_backend")
    with _lock:
        if name not in _loaded:
            info = BACKENDS[name]
            try:
                module = importlib.import_module(info.module)
            except ImportError as exc:
                raise ConfigError(
                    f"the {name} video backend cannot be imported: {exc}",
                    hint=f"install {info.install_hint} to use it, or pick another backend",
                    code="video_backend_unavailable",
                ) from None
            if module.BACKEND.name != name:  # pragma: no cover - a registration mistake
                raise RuntimeError(f"{info.module} registers {module.BACKEND.name}, not {name}")
            _loaded[name] = module.BACKEND
        return _loaded[name]
