"""Typed configuration objects. The CLI builds these from flags; the core sees nothing else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine import envs
from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.media.video.options import VideoLoadSpec

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")


def normalize_host(host: str) -> str:
    """Lower-case, IDNA-encoded, without a trailing dot or IPv6 brackets: the form compared."""
    host = host.strip().strip("[]").rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        return host


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from: the operator's allow-lists.

    ``allowed_domains``: exact host names (after :func:`normalize_host`). When non-empty only
    these hosts are fetched; a listed host may also resolve to private addresses. When empty
    any host on a public address is fetched.
    ``allowed_local_path``: the only folder ``file://`` URLs may read; ``None`` refuses them.
    """

    allowed_domains: frozenset[str] = frozenset()
    allowed_local_path: Path | None = None
    max_redirects: int = 3

    @classmethod
    def create(
        cls,
        *,
        allowed_domains: list[str] | tuple[str, ...] | None = None,
        allowed_local_path: str | os.PathLike[str] | None = None,
        max_redirects: int | None = None,
    ) -> MediaPolicy:
        """Validate operator input: the local folder must exist and be a directory."""
        domains = frozenset(normalize_host(d) for d in (allowed_domains or ()) if d.strip())
        local: Path | None = None
        if allowed_local_path is not None and str(allowed_local_path) != "":
            candidate = Path(allowed_local_path).expanduser()
            if not candidate.exists():
                raise ConfigError(
                    f"--allowed-local-media-path {candidate} does not exist",
                    hint="create the folder or point --allowed-local-media-path at one that exists",
                )
            if not candidate.is_dir():
                raise ConfigError(
                    f"--allowed-local-media-path {candidate} is not a directory",
                    hint="pass a folder, not a file, to --allowed-local-media-path",
                )
            local = candidate.resolve(strict=True)
        redirects = envs.APHRODITE_MEDIA_MAX_REDIRECTS if max_redirects is None else max_redirects
        return cls(allowed_domains=domains, allowed_local_path=local, max_redirects=redirects)


@dataclass(frozen=True)
class ModalityLimits:
    """Caps for one modality."""

    max_bytes: int
    fetch_timeout_s: float


@dataclass(frozen=True)
class MediaLimits:
    """Byte, time, pixel and duration caps for media, per modality."""

    image: ModalityLimits
    video: ModalityLimits
    audio: ModalityLimits
    max_image_pixels: int
    max_audio_seconds: float
    max_video_frame_pixels: int = 4096 * 2304
    max_video_frames: int = 100_000
    max_video_decoded_bytes: int = 2 << 30
    fetch_retries: int = 2
    max_jpeg_scan_pixels: int = 16 * 40_000_000
    max_audio_decode_samples: int = 600 * 48_000 * 2
    image_background: tuple[int, int, int] = field(default=(255, 255, 255))

    def for_modality(self, modality: Modality) -> ModalityLimits:
        return getattr(self, modality)

    @classmethod
    def from_env(cls, **overrides: object) -> MediaLimits:
        """Defaults from the ``APHRODITE_*`` variables; keyword overrides win."""
        per_modality = {
            m: ModalityLimits(envs.get(f"APHRODITE_MAX_{m.upper()}_BYTES"),
                              envs.get(f"APHRODITE_{m.upper()}_FETCH_TIMEOUT"))
            for m in MODALITIES
        }
        limits = cls(
            **per_modality,
            max_image_pixels=envs.APHRODITE_MAX_IMAGE_PIXELS,
            max_audio_seconds=envs.APHRODITE_MAX_AUDIO_SECONDS,
            max_video_frame_pixels=envs.APHRODITE_MAX_VIDEO_FRAME_PIXELS,
            max_video_frames=envs.APHRODITE_MAX_VIDEO_FRAMES,
            max_video_decoded_bytes=envs.APHRODITE_MAX_VIDEO_DECODED_BYTES,
            fetch_retries=envs.APHRODITE_MEDIA_FETCH_RETRIES,
            max_jpeg_scan_pixels=envs.APHRODITE_MAX_JPEG_SCAN_PIXELS,
            max_audio_decode_samples=envs.APHRODITE_MAX_AUDIO_DECODE_SAMPLES,
            image_background=envs.APHRODITE_IMAGE_BACKGROUND,
        )
        return replace(limits, **overrides) if overrides else limits  # type: ignore[arg-type]


def _default_video() -> VideoLoadSpec:
    from engine.media.video.options import server_video_spec

    return server_video_spec(None)


#: Who may set which ``mm_processor_kwargs`` per request: "any" key the processor takes (the
#: offline LLM: its caller is the operator), or only the bounded few a server's clients may
#: (``engine.processing.kwargs.REQUEST_KWARGS``).
RequestKwargs = Literal["any", "bounded"]


@dataclass(frozen=True)
class PipelineConfig:
    """The request pipeline's settings, resolved once where they enter (the ``serve`` flags,
    ``LLM(...)``'s arguments): the media policy and the video options as checked, typed
    objects; frozen and picklable, so the start-up check and every API server get the very
    objects the flags became. What needs the model (the item limits capped by the family's,
    the processor kwargs checked against its processor) is resolved by the
    :class:`~engine.processing.pipeline.Pipeline` built from this and the model."""

    policy: MediaPolicy = field(default_factory=MediaPolicy.create)
    video: VideoLoadSpec = field(default_factory=_default_video)
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4.0
    request_kwargs: RequestKwargs = "any"
    #: rescale + normalize pixels on the model's device where the family allows (vLLM's
    #: --mm-device-do-normalize, on by default as there)
    mm_device_do_normalize: bool = True

    @classmethod
    def create(cls, *, allowed_media_domains: tuple[str, ...] | list[str] | None = None,
               allowed_local_media_path: str | os.PathLike[str] | None = None,
               media_io_kwargs: dict[str, Any] | None = None,
               limit_mm_per_prompt: dict[str, int] | None = None,
               mm_processor_kwargs: dict[str, Any] | None = None,
               mm_processor_cache_gb: float = 4.0,
               request_kwargs: RequestKwargs = "any",
               mm_device_do_normalize: bool = True) -> PipelineConfig:
        """From the flags' values; a bad one is a :class:`ConfigError` naming its flag."""
        from engine.media.video.options import server_video_spec
        from engine.processing.limits import check_limit_flag

        check_limit_flag(limit_mm_per_prompt)
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ConfigError("--mm-processor-kwargs must be a JSON object",
                              code="invalid_flag")
        return cls(policy=MediaPolicy.create(allowed_domains=allowed_media_domains,
                                             allowed_local_path=allowed_local_media_path),
                   video=server_video_spec(media_io_kwargs),
                   limit_mm_per_prompt=limit_mm_per_prompt,
                   mm_processor_kwargs=mm_processor_kwargs,
                   mm_processor_cache_gb=mm_processor_cache_gb, request_kwargs=request_kwargs,
                   mm_device_do_normalize=mm_device_do_normalize)
