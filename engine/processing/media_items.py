"""Fetched media -> :class:`MediaItem` with a lazy decoder (runs only on a cache miss)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine.config import MediaLimits
from engine.media.audio import decode_audio
from engine.media.connector import MediaConnector
from engine.media.image import decode_image
from engine.media.video import load_video
from engine.media.video.options import VideoLoadSpec
from engine.processing.preprocess import MediaItem


def item_for(modality: str, data: bytes, limits: MediaLimits, video: VideoLoadSpec,
             sampling_rate: int, video_decoder: Any = None) -> MediaItem:
    """A MediaItem whose hash is the encoded bytes and whose decode runs the media path
    (videos through ``video_decoder``, e.g. decode worker processes, when given)."""
    if modality == "image":
        return MediaItem("image", encoded=data, decode=lambda: decode_image(data, limits),
                         media_kwargs={"background": limits.image_background})
    if modality == "video":
        def decode_video() -> Any:
            if video_decoder is not None:
                return video_decoder.decode(data, video, limits).frames
            return load_video(data, video, limits).frames

        return MediaItem("video", encoded=data, decode=decode_video, media_kwargs={
            "backend": video.backend, "options": repr(video.options),
            "sampling": repr(video.sampling)})

    def decode() -> Any:
        clip = decode_audio(data, sampling_rate=sampling_rate,
                            max_seconds=limits.max_audio_seconds)
        return clip.samples, clip.sampling_rate

    return MediaItem("audio", encoded=data, decode=decode,
                     media_kwargs={"sampling_rate": sampling_rate})


async def fetch_items(connector: MediaConnector, media: list[tuple[str, str]],
                      video: VideoLoadSpec, sampling_rate: int, video_decoder: Any = None
                      ) -> tuple[list[MediaItem], float]:
    """Check every reference first (a refusal fetches nothing), then fetch concurrently."""
    start = time.perf_counter()
    sources = await connector.check_all([(url, modality) for modality, url in media])
    fetched = await asyncio.gather(*(connector.fetch(s) for s in sources))
    items = [item_for(f.modality, f.data, connector.limits, video, sampling_rate,
                      video_decoder) for f in fetched]
    return items, time.perf_counter() - start
