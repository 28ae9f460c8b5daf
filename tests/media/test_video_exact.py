"""Every CPU backend returns the same frames as the ffmpeg CLI, on every clip kind.

Policy (also in the README): frames are returned as displayed (the container's rotation
applied, as the ffmpeg CLI does), RGB24. pyav, torchcodec and opencv are pixel-identical to
the CLI, except opencv on sources above 8 bits per component, whose internal scaler converts
without the CLI's dithering: same frames, pixels within a few levels on average. deepstream's
software path converts with GStreamer's videoconvert: same frames, pixels within a few levels.
The right *frame* is always checked through the frame number drawn into each frame.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import MediaLimits
from engine.errors import ConfigError, UnsupportedMediaError
from engine.media.video import load_video
from engine.media.video.options import build_spec
from tests.fixtures import synthetic
from tests.video_clips import CLIPS, clip, reference_frames

pytestmark = pytest.mark.needs_ffmpeg_cli

BACKENDS = ["pyav", "pyav-full", "opencv", "torchcodec", "deepstream"]


def spec_for(backend: str, **sampling):
    if backend == "pyav-full":
        return build_spec({"backend": "pyav", "skip_nonref": False, **sampling}, "pyav",
                          error=ConfigError)
    return build_spec({"backend": backend, **sampling}, backend, error=ConfigError)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CLIPS))
def test_backend_matches_ffmpeg_cli(tmp_path, name, backend):
    data = clip(name)
    path = tmp_path / "clip"
    path.write_bytes(data)
    reference = reference_frames(name, str(path))
    if backend == "opencv" and name == "av1":
        with pytest.raises(UnsupportedMediaError, match="OpenCV cannot decode"):
            load_video(data, spec_for(backend, num_frames=8), MediaLimits.from_env())
        return
    result = load_video(data, spec_for(backend, num_frames=8), MediaLimits.from_env())
    indices = result.metadata.sampled_indices
    assert result.metadata.total_frames == len(reference)
    assert len(indices) == min(8, len(reference)) and result.frames.shape[0] == len(indices)
    expected = reference[indices]
    assert result.frames.shape == expected.shape
    diff = np.abs(result.frames.astype(np.int16) - expected.astype(np.int16))
    approximate = backend == "deepstream" or (backend == "opencv" and name == "10-bit")
    if approximate:
        assert diff.mean() < (4.0 if name == "10-bit" else 2.5), diff.mean()
    else:
        assert diff.max() == 0, f"max pixel difference {diff.max()}"
    if name != "odd-dimensions":  # the 67-pixel-wide band is too narrow to read reliably
        rotation = CLIPS[name].get("rotation", 0)
        shown = [np.rot90(f, -rotation // 90) if rotation else f for f in result.frames]
        assert [synthetic.read_frame_index(f) for f in shown] == indices


def test_every_backend_samples_the_same_indices():
    data = clip("variable-frame-rate")
    seen = {b: load_video(data, spec_for(b, num_frames=5), MediaLimits.from_env())
            .metadata.sampled_indices for b in BACKENDS}
    assert len({tuple(v) for v in seen.values()}) == 1 and seen["pyav"] == [0, 3, 6, 9, 12]


def test_header_frame_count_is_not_trusted():
    """MKV/WebM carry no frame count; the scan counts packets instead."""
    result = load_video(clip("mkv-no-frame-count"), spec_for("pyav"), MediaLimits.from_env())
    assert result.metadata.header_frames is None and result.metadata.total_frames == 30


@pytest.mark.parametrize("backend", BACKENDS)
def test_edit_list_clip(tmp_path, backend):
    """A stream-copied cut: the MP4 header still claims every frame, an edit list hides the
    first ones. Every backend must count and return what the ffmpeg CLI shows."""
    import subprocess

    source = tmp_path / "in.mp4"
    source.write_bytes(clip("h264-bframes-long-gop"))
    cut = tmp_path / "cut.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-ss", "0.55", "-i", str(source), "-c",
                    "copy", str(cut)], check=True)
    out = subprocess.run(["ffmpeg", "-v", "error", "-i", str(cut), "-fps_mode", "passthrough",
                          "-f", "rawvideo", "-pix_fmt", "rgb24", "-"], capture_output=True,
                         check=True).stdout
    reference = np.frombuffer(out, np.uint8).reshape(-1, 120, 160, 3)
    result = load_video(cut.read_bytes(), spec_for(backend, num_frames=6), MediaLimits.from_env())
    meta = result.metadata
    assert meta.header_frames == 90 and meta.total_frames == len(reference) < 90
    assert [synthetic.read_frame_index(f) for f in result.frames] == [
        synthetic.read_frame_index(reference[i]) for i in meta.sampled_indices]
    diff = np.abs(result.frames.astype(np.int16) - reference[meta.sampled_indices])
    assert (diff.mean() < 4.0) if backend == "deepstream" else (diff.max() == 0)


def test_the_recipes_hold_the_test_clips_and_the_benchmark_clip_is_defined_once():
    from aphrodite_cli.bench.offline.video_decode import STANDARD_CLIP

    assert len(CLIPS) == 12 and STANDARD_CLIP not in CLIPS.values()


def test_gop_structure_is_detected():
    from engine.media.video.scan import scan_video

    short = scan_video(clip("h264-short-gops"), MediaLimits.from_env())
    assert len(short.keyframe_pts) >= 4 and not short.open_gop
    assert scan_video(clip("h264-open-gop"), MediaLimits.from_env()).open_gop
