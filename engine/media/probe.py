"""``aphrodite media probe``: run one media reference through exactly the serving path.

The same :class:`~engine.media.connector.MediaConnector` checks and fetches it, and the same
decoders turn it into what the model would receive; the report says what happened at each step
or which rule refused it.
"""

from __future__ import annotations

import asyncio
import mimetypes
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import MODALITIES, MediaLimits, MediaPolicy, Modality
from engine.errors import AphroditeError, InvalidRequestError
from engine.media.audio import DEFAULT_SAMPLING_RATE, decode_audio
from engine.media.connector import MediaConnector
from engine.media.image import decode_image, probe_image
from engine.media.video.info import probe_video
from engine.media.video.loader import decode_planned, plan_scanned
from engine.media.video.options import VideoLoadSpec, server_video_spec
from engine.media.video.scan import scan_video


@dataclass
class ProbeReport:
    """Everything ``media probe`` learned about one source."""

    source: str
    modality: Modality
    ok: bool = False
    kind: str | None = None
    mime: str | None = None
    declared_mime: str | None = None
    bytes: int | None = None
    fetch_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    sent_to_model: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def guess_modality(source: str) -> Modality | None:
    """The modality a data URL's MIME type or a path's extension suggests."""
    if source[:5].lower() == "data:":
        mime = source[5:].split(",", 1)[0].split(";", 1)[0].lower()
    else:
        mime = mimetypes.guess_type(source.split("?", 1)[0].split("#", 1)[0])[0] or ""
    top = mime.split("/", 1)[0]
    return top if top in MODALITIES else None  # type: ignore[return-value]


async def probe_source(
    source: str,
    modality: Modality | None,
    policy: MediaPolicy,
    limits: MediaLimits,
    *,
    sampling_rate: int = DEFAULT_SAMPLING_RATE,
    video: VideoLoadSpec | None = None,
) -> ProbeReport:
    """Check, fetch and decode ``source`` as ``serve`` would (``video``: its video options,
    checked by the caller; default: the server's defaults); never raises a client error."""
    video = video or server_video_spec(None)
    chosen = modality or guess_modality(source)
    if chosen is None:
        raise InvalidRequestError(
            f"cannot tell whether {source[:60]!r} is an image, a video or audio",
            hint="pass --modality image|video|audio",
            code="modality_unknown",
        )
    report = ProbeReport(source=source if len(source) < 200 else source[:80] + "…",
                         modality=chosen)
    try:
        async with MediaConnector(policy, limits) as connector:
            checked = await connector.check(source, chosen)
            report.kind = checked.kind
            report.source = checked.display
            fetched = await connector.fetch(checked)
        report.mime, report.declared_mime = fetched.mime, fetched.declared_mime
        report.bytes, report.fetch_s = fetched.size, round(fetched.fetch_s, 4)
        await asyncio.to_thread(_decode_into, report, fetched.data, limits, sampling_rate,
                                video)
        report.ok = True
    except AphroditeError as err:
        report.error = {"status": err.status, "code": err.code, "type": err.type,
                        "message": err.message, "hint": err.hint}
    return report


def _decode_into(report: ProbeReport, data: bytes, limits: MediaLimits, rate: int,
                 video: VideoLoadSpec) -> None:
    if report.modality == "image":
        info = probe_image(data, limits)
        report.details = asdict(info)
        image = decode_image(data, limits)
        report.sent_to_model = {"type": "image", "mode": image.mode,
                                "width": image.width, "height": image.height}
    elif report.modality == "audio":
        clip = decode_audio(data, sampling_rate=rate, max_seconds=limits.max_audio_seconds)
        report.details = {"codec": clip.codec, "sampling_rate": clip.source_rate,
                          "channels": clip.source_channels,
                          "duration_s": round(clip.duration_s, 3)}
        report.sent_to_model = {"type": "audio", "dtype": "float32", "channels": 1,
                                "samples": int(clip.samples.shape[0]), "sampling_rate": rate}
    else:
        start = time.perf_counter()
        scan = scan_video(data, limits)  # once: for the facts and for the decode
        report.details = probe_video(data, limits, scan)
        clip = decode_planned(data, video, scan, plan_scanned(scan, video, limits),
                              time.perf_counter() - start)
        meta = clip.metadata
        report.sent_to_model = {"type": "video", "frames": int(clip.frames.shape[0]),
                                "height": meta.height, "width": meta.width,
                                "backend": meta.backend, "decode_s": meta.decode_s,
                                "sampled_indices": meta.sampled_indices}
