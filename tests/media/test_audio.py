"""Audio decoding: mono float32 at the requested rate, duration cap, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from engine.media.audio import decode_audio
from tests.fixtures import synthetic


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg"])
def test_formats_decode_to_mono_float32_at_the_rate(fmt):
    clip = decode_audio(synthetic.make_audio(seconds=1.0, fmt=fmt), sampling_rate=16_000,
                        max_seconds=60)
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert clip.sampling_rate == 16_000
    assert abs(clip.duration_s - 1.0) < 0.08  # lossy codecs pad a frame or two
    assert 0.2 < float(np.abs(clip.samples).max()) <= 1.0
    assert clip.source_channels == 2


def test_resampling_keeps_the_pitch():
    """A 440 Hz tone stays at 440 Hz after 22.05 kHz -> 8 kHz (the dominant FFT bin)."""
    wav = synthetic.make_audio(seconds=1.0, freq=440.0, fmt="wav")
    clip = decode_audio(wav, sampling_rate=8000, max_seconds=60)
    spectrum = np.abs(np.fft.rfft(clip.samples[:4000]))
    peak_hz = np.argmax(spectrum) * 8000 / 4000
    assert 400 < peak_hz < 700  # the sweep rises from 440 Hz over the clip


def test_duration_cap():
    wav = synthetic.make_audio(seconds=3.0)
    with pytest.raises(MediaTooLargeError) as info:
        decode_audio(wav, max_seconds=1.0)
    assert info.value.status == 413 and "APHRODITE_MAX_AUDIO_SECONDS" in info.value.hint


def test_garbage_is_a_400_unsupported_media_type():
    with pytest.raises(UnsupportedMediaError) as info:
        decode_audio(b"\x00\x01" * 1000, max_seconds=60)
    assert (info.value.status, info.value.code) == (400, "unsupported_media_type")


def test_video_without_audio_is_422():
    video = synthetic.make_video(width=64, height=48, seconds=0.2)
    with pytest.raises(MediaDecodeError, match="no audio stream"):
        decode_audio(video, max_seconds=60)


def test_truncated_audio_fails_cleanly_or_decodes_what_is_there():
    mp3 = synthetic.make_audio(seconds=1.0, fmt="mp3")
    try:
        clip = decode_audio(mp3[:200], max_seconds=60)
    except (MediaDecodeError, UnsupportedMediaError) as err:
        assert 400 <= err.status < 500
    else:
        assert clip.duration_s < 0.5
