"""Fetched media -> :class:`MediaItem` with a lazy decoder (runs only on a cache miss)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from engine.config import MediaLimits
from engine.media import decode_deadline
from engine.media.audio import decode_audio
from engine.media.connector import MediaConnector
from engine.media.decode_errors import as_decode_error
from engine.media.image import decode_image
from engine.media.inflight import Ticket
from engine.media.policy import MediaSource
from engine.media.video import load_video
from engine.media.video.options import VideoLoadSpec
from engine.processing.preprocess import MediaItem

if TYPE_CHECKING:
    from engine.media.video.loader import VideoFrames, VideoMetadata


class InProcessDecoders:
    """The decoding calls of :class:`~engine.media.isolation.DecodeWorkers`, run here (any
    decoder exception is the item's client error, as it is from a worker). ``budget_s``:
    seconds one video or audio decode may take, checked between frames
    (:mod:`engine.media.decode_deadline`); 0: none."""

    def __init__(self, budget_s: float = 0.0) -> None:
        self.budget_s = budget_s

    def for_client(self, client: str) -> InProcessDecoders:
        """The same decoders (threads are not shared out per client, the decode pool is)."""
        return self

    def decode_image(self, data: bytes, limits: MediaLimits) -> Any:
        try:
            return decode_image(data, limits)
        except Exception as exc:
            raise as_decode_error("image", exc) from None

    def decode_image_pixels(self, data: bytes, limits: MediaLimits) -> Any:
        import numpy as np

        return np.asarray(self.decode_image(data, limits))

    def decode_video(self, data: bytes, spec: VideoLoadSpec, limits: MediaLimits) -> Any:
        try:
            with decode_deadline.budget(self.budget_s, "video"):
                return load_video(data, spec, limits)
        except Exception as exc:
            raise as_decode_error("video", exc) from None

    def decode_audio(self, data: bytes, *, sampling_rate: int, max_seconds: float) -> Any:
        try:
            with decode_deadline.budget(self.budget_s, "audio"):
                return decode_audio(data, sampling_rate=sampling_rate,
                                    max_seconds=max_seconds)
        except Exception as exc:
            raise as_decode_error("audio", exc) from None


def hf_video_metadata(meta: VideoMetadata) -> dict[str, Any]:
    """A decoded clip's metadata as Hugging Face's ``video_metadata`` (timestamps come from
    ``frames_indices / fps``)."""
    return {"total_num_frames": meta.total_frames, "fps": meta.fps,
            "frames_indices": list(meta.sampled_indices), "duration": meta.duration_s,
            "width": meta.width, "height": meta.height, "video_backend": meta.backend}


def use_frames(item: MediaItem, video: VideoFrames) -> Any:
    """Record a decoded clip on its item: the metadata, and the frames (returned)."""
    item.metadata = hf_video_metadata(video.metadata)
    return video.frames


def item_for(modality: str, data: bytes, limits: MediaLimits, video: VideoLoadSpec,
             sampling_rate: int, decoders: Any = None) -> MediaItem:
    """A MediaItem whose hash is the encoded bytes and whose decode runs the media path
    (in ``decoders``, the decode worker processes, when given; else in this process)."""
    run = decoders if decoders is not None else InProcessDecoders()
    if modality == "image":
        return MediaItem("image", encoded=data, decode=lambda: run.decode_image(data, limits),
                         decode_pixels=lambda: run.decode_image_pixels(data, limits),
                         media_kwargs={"background": limits.image_background})
    if modality == "video":
        item = MediaItem("video", encoded=data,
                         media_kwargs={"backend": video.backend, "options": repr(video.options),
                                       "sampling": repr(video.sampling)})

        def decode_video() -> Any:
            return use_frames(item, run.decode_video(data, video, limits))

        item.decode = decode_video
        return item

    def decode() -> Any:
        clip = run.decode_audio(data, sampling_rate=sampling_rate,
                                max_seconds=limits.max_audio_seconds)
        return clip.samples, clip.sampling_rate

    return MediaItem("audio", encoded=data, decode=decode,
                     media_kwargs={"sampling_rate": sampling_rate})


async def fetch_items(connector: MediaConnector, media: list[tuple[str, str]],
                      video: VideoLoadSpec, sampling_rate: int, decoders: Any = None,
                      ticket: Ticket | None = None, sources: list[MediaSource] | None = None,
                      started: float | None = None) -> tuple[list[MediaItem], float]:
    """Check every reference first (a refusal fetches nothing; ``sources`` when the caller
    checked them already), then fetch concurrently; http deadlines count from ``started``."""
    start = time.perf_counter()
    if sources is None:
        sources = await connector.check_all([(url, modality) for modality, url in media])
    tasks = [asyncio.ensure_future(connector.fetch(s, ticket, started)) for s in sources]
    try:
        fetched = await asyncio.gather(*tasks)
    except BaseException:  # one failed: stop the others before their bytes are charged
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    items = [item_for(f.modality, f.data, connector.limits, video, sampling_rate,
                      decoders) for f in fetched]
    return items, time.perf_counter() - start
