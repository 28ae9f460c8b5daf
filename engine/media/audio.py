"""Audio decoding with PyAV: any FFmpeg-readable input to mono float32 at a chosen rate."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError, sanitize
from engine.media import decode_deadline

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


def _too_costly(samples: float, cap: int, estimated: bool) -> MediaTooLargeError:
    how = "its header says it holds" if estimated else "it holds more than"
    return MediaTooLargeError(
        f"the audio is too costly to decode: {how} {samples:.0f} samples (channels x rate x "
        f"duration), over the {cap}-sample budget",
        hint="send fewer channels or a lower sample rate, or raise "
             "APHRODITE_MAX_AUDIO_DECODE_SAMPLES", code="audio_decode_too_costly")


def decode_audio(
    data: bytes, *, sampling_rate: int = DEFAULT_SAMPLING_RATE, max_seconds: float,
    max_decode_samples: int | None = None,
) -> AudioClip:
    """Decode and resample to mono float32; refuses clips longer than ``max_seconds`` and
    clips whose decode work (samples of every channel at the source rate) is over
    ``max_decode_samples`` (default: ``APHRODITE_MAX_AUDIO_DECODE_SAMPLES``): estimated from
    the header before decoding, then counted on each decoded frame before it is resampled
    (a 1 Hz clip with no length in its header resamples each frame to millions of samples)."""
    import av  # heavy: only when audio is used

    if max_decode_samples is None:
        from engine import envs

        max_decode_samples = envs.APHRODITE_MAX_AUDIO_DECODE_SAMPLES
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
        channels, rate = stream.channels or 1, stream.rate or 0
        if container.duration is not None and rate:
            estimate = channels * rate * container.duration / 1e6
            if estimate > max_decode_samples:
                raise _too_costly(estimate, max_decode_samples, estimated=True)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
        pieces: list[np.ndarray] = []
        total = 0
        source_seconds = 0.0
        source_samples = 0
        for frame in container.decode(stream):
            decode_deadline.check()
            # checked on the source frame, before the resampler multiplies it
            source_samples += frame.samples * max(len(frame.layout.channels), 1)
            if source_samples > max_decode_samples:
                raise _too_costly(source_samples, max_decode_samples, estimated=False)
            source_seconds += frame.samples / (frame.sample_rate or rate or 1)
            if source_seconds > max_seconds:
                raise _too_long(source_seconds, max_seconds)
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
