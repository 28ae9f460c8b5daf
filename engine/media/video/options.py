"""Typed options per video backend, and the parsing of ``media_io_kwargs["video"]``.

Server-wide kwargs come from ``--media-io-kwargs '{"video": {...}}'`` (or the backend from
``APHRODITE_VIDEO_LOADER_BACKEND``); a request's ``media_io_kwargs.video`` is merged over them.
A request may pick a GPU backend only if the server was started with it. Unknown backends,
unknown options and options that belong to another backend are errors that say so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from engine import envs
from engine.errors import ConfigError, InvalidRequestError
from engine.media.video.backend_info import BACKENDS, CPU_NAMES, GPU_NAMES, NAMES
from engine.media.video.sampling import DEFAULT_NUM_FRAMES, SamplingRequest

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("num_frames", "fps", "max_duration")


def _int_at_least(low: int):
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer of at least {low}")
        return value
    return check


def _choice(*allowed: str):
    def check(name: str, value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")
        return value
    return check


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be true or false")
    return value


@dataclass(frozen=True)
class BackendOptions:
    """Base of the per-backend option classes."""

    backend: ClassVar[str] = ""
    checks: ClassVar[dict[str, Any]] = {}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class OpenCVOptions(BackendOptions):
    """OpenCV (FFmpeg underneath): grabs every frame, converts only the sampled ones."""

    backend: ClassVar[str] = "opencv"


@dataclass(frozen=True)
class PyAVOptions(BackendOptions):
    """PyAV: ``threads`` (0 = FFmpeg's choice); ``skip_nonref`` skips decoding non-reference
    frames that no sampled frame needs (the frames returned are unchanged)."""

    backend: ClassVar[str] = "pyav"
    checks: ClassVar[dict[str, Any]] = {"threads": _int_at_least(0), "skip_nonref": _boolean}
    threads: int = 0
    skip_nonref: bool = True


@dataclass(frozen=True)
class TorchCodecOptions(BackendOptions):
    """torchcodec: ``num_ffmpeg_threads`` (0 = FFmpeg's default) and ``seek_mode`` (``exact``:
    frame-accurate from a scan; ``approximate``: trusts the container's metadata)."""

    backend: ClassVar[str] = "torchcodec"
    checks: ClassVar[dict[str, Any]] = {"num_ffmpeg_threads": _int_at_least(0),
                                        "seek_mode": _choice("exact", "approximate")}
    num_ffmpeg_threads: int = 0
    seek_mode: Literal["exact", "approximate"] = "exact"


@dataclass(frozen=True)
class PyNvVideoCodecOptions(BackendOptions):
    """NVIDIA NVDEC through PyNvVideoCodec: ``hw_decoders`` slots kept per API server process
    (reserved at startup), ``gpu_id``."""

    backend: ClassVar[str] = "pynvvideocodec"
    checks: ClassVar[dict[str, Any]] = {"hw_decoders": _int_at_least(1),
                                        "gpu_id": _int_at_least(0)}
    hw_decoders: int = 2
    gpu_id: int = 0


def _default_pool_size() -> int:
    return envs.APHRODITE_MEDIA_LOADING_THREAD_COUNT


@dataclass(frozen=True)
class DeepStreamOptions(BackendOptions):
    """GStreamer pipeline with NVIDIA's decoder when present: ``pool_size`` decode workers in
    one process-wide pool (clamped to 1..16), ``decoder`` ``auto``/``nvidia``/``software``."""

    backend: ClassVar[str] = "deepstream"
    checks: ClassVar[dict[str, Any]] = {"pool_size": _int_at_least(1),
                                        "decoder": _choice("auto", "nvidia", "software")}
    pool_size: int = field(default_factory=_default_pool_size)
    decoder: Literal["auto", "nvidia", "software"] = "auto"

    def __post_init__(self) -> None:
        clamped = min(max(self.pool_size, 1), 16)
        if clamped != self.pool_size:
            logger.warning("deepstream pool_size=%s clamped to %s", self.pool_size, clamped)
            object.__setattr__(self, "pool_size", clamped)


OPTION_CLASSES: dict[str, type[BackendOptions]] = {
    cls.backend: cls for cls in (OpenCVOptions, PyAVOptions, TorchCodecOptions,
                                 PyNvVideoCodecOptions, DeepStreamOptions)
}
if set(OPTION_CLASSES) != set(NAMES):  # pragma: no cover - a registration mistake
    raise RuntimeError("every backend in backend_info.BACKENDS needs its options class here")
if envs.VIDEO_BACKENDS != NAMES:  # pragma: no cover - a registration mistake
    raise RuntimeError("engine.envs.VIDEO_BACKENDS must list backend_info.BACKENDS' names")


@dataclass(frozen=True)
class VideoLoadSpec:
    """A resolved choice: backend, its typed options, and the sampling request. A request's
    overrides make a new one with ``dataclasses.replace`` (see :func:`parse_video_io_kwargs`)."""

    backend: str
    options: BackendOptions
    sampling: SamplingRequest


def _owner_of(key: str) -> str | None:
    return next((name for name, cls in OPTION_CLASSES.items() if key in cls.names()), None)


def _check_backend(backend: Any, hint: str, error: type) -> type[BackendOptions]:
    if not isinstance(backend, str) or backend not in OPTION_CLASSES:
        raise error(
            f"unknown video backend {backend!r}; valid backends: {', '.join(NAMES)}",
            hint=f"set \"backend\" in {hint} to one of them", code="unknown_video_backend")
    return OPTION_CLASSES[backend]


def _typed(kwargs: dict[str, Any], cls: type[BackendOptions], hint: str, error: type
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``video`` kwargs dict checked key by key: (the backend's option values, the
    sampling values), each of its type; anything else is an ``error`` naming the key."""
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "backend" or key in SAMPLING_KEYS:
            continue
        if key not in cls.names():
            owner = _owner_of(key)
            if owner is not None:
                raise error(
                    f"video option {key!r} belongs to the {owner} backend, not {cls.backend}",
                    hint=f'remove {key!r} or set "backend": "{owner}" in {hint}',
                    code="video_option_wrong_backend")
            valid = ", ".join((*cls.names(), *SAMPLING_KEYS))
            raise error(f"unknown video option {key!r}; valid for {cls.backend}: {valid}",
                        hint=f"fix {hint}", code="unknown_video_option")
        try:
            values[key] = cls.checks[key](key, value)
        except ValueError as exc:
            raise error(str(exc), hint=f"fix {hint}", code="invalid_video_option") from None
    return values, {k: kwargs[k] for k in SAMPLING_KEYS if k in kwargs}


def _sampling(make: Any, hint: str, error: type) -> SamplingRequest:
    try:
        return make()
    except InvalidRequestError as exc:
        raise error(exc.message, hint=f"fix {hint}", code=exc.code) from None


def build_spec(kwargs: dict[str, Any], default_backend: str, *, error: type) -> VideoLoadSpec:
    """Validate one ``video`` kwargs dict into a spec; ``error`` is the class raised."""
    hint = ("--media-io-kwargs" if error is ConfigError
            else "media_io_kwargs.video in the request")
    if not isinstance(kwargs, dict):
        raise error(f"video media_io_kwargs must be a JSON object, not {kwargs!r}", hint=hint)
    backend = kwargs.get("backend", default_backend)
    cls = _check_backend(backend, hint, error)
    values, sampling = _typed(kwargs, cls, hint, error)
    return VideoLoadSpec(backend, cls(**values),
                         _sampling(lambda: SamplingRequest(**sampling), hint, error))


def server_video_spec(media_io_kwargs: dict[str, Any] | None) -> VideoLoadSpec:
    """The server-wide spec from ``--media-io-kwargs`` and ``APHRODITE_VIDEO_LOADER_BACKEND``."""
    video = dict((media_io_kwargs or {}).get("video") or {})
    return build_spec(video, envs.APHRODITE_VIDEO_LOADER_BACKEND, error=ConfigError)


def parse_video_io_kwargs(
    request_kwargs: dict[str, Any] | None, server: VideoLoadSpec
) -> VideoLoadSpec:
    """A request's ``media_io_kwargs.video`` over the server's spec: its values checked one
    by one, then put on the server's typed spec with ``dataclasses.replace`` (the server's
    sampling and, for the same backend, its options stay where the request says nothing)."""
    if not request_kwargs:
        return server
    hint = "media_io_kwargs.video in the request"
    if not isinstance(request_kwargs, dict):
        raise InvalidRequestError("media_io_kwargs.video must be a JSON object",
                                  param="media_io_kwargs")
    backend = request_kwargs.get("backend", server.backend)
    cls = _check_backend(backend, hint, InvalidRequestError)
    if backend in GPU_NAMES and backend != server.backend:
        raise InvalidRequestError(
            f"video backend {backend!r} can only be used when the server was started with it",
            hint=f"start the server with --media-io-kwargs '{{\"video\": {{\"backend\": "
                 f"\"{backend}\"}}}}' or pick a CPU backend ({', '.join(CPU_NAMES)})",
            code="video_backend_not_enabled", param="media_io_kwargs")
    # Options fixed when the server starts: a request may repeat the server's value, and
    # another is refused (it would have no effect).
    for key in BACKENDS[backend].startup_only:
        if key in request_kwargs:
            if request_kwargs[key] != getattr(server.options, key, None):
                raise InvalidRequestError(
                    f"media_io_kwargs.video {key}={request_kwargs[key]!r} cannot be set per "
                    f"request: {backend} fixes it when the server starts",
                    hint=f"leave {key} out of the request; the operator sets it with "
                         "--media-io-kwargs", code="invalid_video_option",
                    param=f"media_io_kwargs.video.{key}")
            request_kwargs = {k: v for k, v in request_kwargs.items() if k != key}
    asked = request_kwargs.get("num_frames")
    ceiling = max(server.sampling.num_frames, DEFAULT_NUM_FRAMES)
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > ceiling:
        # Frames are the memory a request can cause (decoded RGB, then the processor's
        # float tensors): a request may ask for fewer than the server's own, never more.
        raise InvalidRequestError(
            f"media_io_kwargs.video num_frames={asked} is over this server's per-request "
            f"maximum of {ceiling}",
            hint="ask for fewer frames; the operator raises the maximum with --media-io-kwargs "
                 '\'{"video": {"num_frames": N}}\'', code="invalid_video_sampling",
            param="media_io_kwargs")
    values, sampling = _typed(request_kwargs, cls, hint, InvalidRequestError)
    options = (dataclasses.replace(server.options, **values) if backend == server.backend
               else cls(**values))
    return VideoLoadSpec(backend, options, _sampling(
        lambda: dataclasses.replace(server.sampling, **sampling), hint, InvalidRequestError))


def parse_backend_choice(text: str, *, flag: str) -> dict[str, Any]:
    """The one command-line syntax for a video backend and its options, ``NAME`` or
    ``NAME:KEY=VALUE:KEY=VALUE`` (values read as JSON where they parse: ``threads=2``,
    ``skip_nonref=false``; else as text: ``seek_mode=approximate``), as the ``video`` dict of
    ``--media-io-kwargs``. Keys and values are checked where the dict is used (build_spec)."""
    name, *pairs = text.strip().split(":")
    if not name:
        raise ConfigError(f"{flag} {text!r}: no backend name", code="invalid_flag",
                          hint=f"e.g. {flag} pyav:threads=2; backends: {', '.join(NAMES)}")
    choice: dict[str, Any] = {"backend": name}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not key or not eq:
            raise ConfigError(f"{flag} {text!r}: {pair!r} is not KEY=VALUE", code="invalid_flag",
                              hint=f"e.g. {flag} {name}:threads=2")
        try:
            choice[key] = json.loads(raw)
        except json.JSONDecodeError:
            choice[key] = raw
    return choice


def parse_backend_choices(text: str, *, flag: str) -> list[dict[str, Any]]:
    """A comma-separated list of :func:`parse_backend_choice` (``pyav:threads=2,opencv``)."""
    return [parse_backend_choice(item, flag=flag) for item in text.split(",") if item.strip()]
