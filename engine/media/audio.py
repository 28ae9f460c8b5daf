"""Audio decoding with PyAV: any FFmpeg-readable input to mono float32 at a chosen rate."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError, sanitize

DEFAULT_SAMPLING_RATE = 16_000


@dataclass(frozen=True)
class AudioClip:
    """Decoded audio: mono float32 samples in [-1, 1] at ``sampling_rate``."""

    samples: np.ndarray
    sampling_rate: int
    source_rate: int
    source_channels: int
    codec: str

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sampling_rate


def _too_long(seconds: float, cap: float) -> MediaTooLargeError:
    return MediaTooLargeError(
        f"the audio is {seconds:.1f} s long, over the {cap:g}-second cap",
        hint="send a shorter clip or raise APHRODITE_MAX_AUDIO_SECONDS",
        code="audio_too_long",
    )


def decode_audio(
    data: bytes, *, sampling_rate: int = DEFAULT_SAMPLING_RATE, max_seconds: float
) -> AudioClip:
    """Decode and resample to mono float32; refuses clips longer than ``max_seconds``."""
    import av  # heavy: only when audio is used

    max_samples = int(max_seconds * sampling_rate)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as exc:
        raise UnsupportedMediaError(
            f"the audio could not be opened: {sanitize(exc)}",
            hint="send WAV, MP3, FLAC, OGG/Opus, AAC/M4A or WebM audio",
        ) from None
    try:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise MediaDecodeError("the audio part's file has no audio stream")
        if container.duration is not None and container.duration / 1e6 > max_seconds:
            raise _too_long(container.duration / 1e6, max_seconds)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
        pieces: list[np.ndarray] = []
        total = 0
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                piece = out.to_ndarray().reshape(-1)
                total += len(piece)
                if total > max_samples:
                    raise _too_long(total / sampling_rate, max_seconds)
                pieces.append(piece)
        for out in resampler.resample(None):
            pieces.append(out.to_ndarray().reshape(-1))
        samples = np.concatenate(pieces).astype(np.float32, copy=False) if pieces else None
        if samples is None or samples.size == 0:
            raise MediaDecodeError("the audio decoded to zero samples")
        return AudioClip(samples, sampling_rate, stream.rate or 0,
                         stream.channels or 0, stream.codec_context.name)
    except av.error.FFmpegError as exc:
        raise MediaDecodeError(
            f"the audio is truncated or corrupt: {sanitize(exc)}",
            hint="re-encode the audio and send it again",
        ) from None
    finally:
        container.close()
