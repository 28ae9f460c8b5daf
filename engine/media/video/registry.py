"""Registry of video backends: name -> module, imported only when that backend is chosen."""

from __future__ import annotations

import importlib
import threading

from engine.envs import VIDEO_BACKENDS
from engine.errors import ConfigError
from engine.media.video.backends.base import VideoBackend

_MODULES = {
    "opencv": ("engine.media.video.backends.opencv", "opencv-python-headless"),
    "pyav": ("engine.media.video.backends.pyav", "av"),
    "torchcodec": ("engine.media.video.backends.torchcodec", "torchcodec"),
    "pynvvideocodec": ("engine.media.video.backends.pynvvideocodec",
                       "PyNvVideoCodec (pip install 'aphrodite-toolkit[nvidia]')"),
    "deepstream": ("engine.media.video.backends.deepstream",
                   "GStreamer's Python bindings (python3-gi, python3-gst-1.0)"),
}
if set(_MODULES) != set(VIDEO_BACKENDS):  # pragma: no cover - a registration mistake
    raise RuntimeError("video backend registry and VIDEO_BACKENDS disagree")

_loaded: dict[str, VideoBackend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> VideoBackend:
    """The backend called ``name``, importing its module on first use."""
    if name not in _MODULES:
        raise ConfigError(f"unknown video backend {name!r}; valid backends: "
                          f"{', '.join(VIDEO_BACKENDS)}", code="unknown_video_backend")
    with _lock:
        if name not in _loaded:
            module_name, package = _MODULES[name]
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise ConfigError(
                    f"the {name} video backend cannot be imported: {exc}",
                    hint=f"install {package} to use it, or pick another backend",
                    code="video_backend_unavailable",
                ) from None
            _loaded[name] = module.BACKEND
        return _loaded[name]
