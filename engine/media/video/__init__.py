"""Video decoding: one sampler, one container scan, a registry of backends.

``load_video(data, spec, limits)`` scans the container once (true frame count, fps, rotation),
picks the frame indices with the shared sampler, and asks the chosen backend for exactly those
frames. Every backend returns the same frames for the same clip and request.
"""

from engine.media.video.loader import VideoFrames, VideoMetadata, load_video, load_video_async
from engine.media.video.options import VideoLoadSpec, parse_video_io_kwargs
from engine.media.video.sampling import SamplingRequest, sample_indices

__all__ = [
    "SamplingRequest",
    "VideoFrames",
    "VideoLoadSpec",
    "VideoMetadata",
    "load_video",
    "load_video_async",
    "parse_video_io_kwargs",
    "sample_indices",
]
