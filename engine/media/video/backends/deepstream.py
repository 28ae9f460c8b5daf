"""DeepStream-style backend: a GStreamer pipeline whose decoder is NVIDIA's NVDEC element when
present, with GStreamer's software decoder and converter substituted otherwise.

    filesrc(memfd) ! DEMUX ! PARSE ! DECODE ! CONVERT ! videoflip(auto) ! RGB ! appsink

- DEMUX by container (qtdemux, matroskademux, avidemux, tsdemux), PARSE by codec.
- DECODE/CONVERT: ``nvv4l2decoder ! nvvideoconvert`` on NVIDIA machines with DeepStream's
  plugins, else ``avdec_* / av1dec ! videoconvert``; ``decoder`` option ``auto`` picks NVIDIA
  when its elements exist, ``nvidia`` requires them, ``software`` never uses them.
- The bytes are handed over in an anonymous in-memory file (memfd): no temp file on disk, and
  the demuxer can seek (MP4 files whose index is at the end work).
- ``videoflip video-direction=auto`` applies the container's rotation, as the other backends do.
- Frames leave the pipeline in presentation order and are numbered as FFmpeg numbers them (an
  edit list's straddling first frame, which GStreamer keeps and FFmpeg drops, is skipped).
- Decodes run on one process-wide pool of ``pool_size`` workers (clamped 1..16); the first
  value wins, a later different one is warned about.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np

from engine.errors import ConfigError, MediaDecodeError, UnsupportedMediaError, sanitize
from engine.media.video.backends.base import VideoBackend, stack
from engine.media.video.options import DeepStreamOptions
from engine.media.video.scan import ContainerScan

logger = logging.getLogger(__name__)

_DEMUXERS = {"mov,mp4,m4a,3gp,3g2,mj2": "qtdemux", "matroska,webm": "matroskademux",
             "avi": "avidemux", "mpegts": "tsdemux"}
_PARSERS = {"h264": "h264parse", "hevc": "h265parse", "vp9": "vp9parse", "av1": "av1parse",
            "mpeg4": "mpeg4videoparse", "vp8": None}
_SOFTWARE_DECODERS = {"h264": "avdec_h264", "hevc": "avdec_h265", "vp9": "avdec_vp9",
                      "av1": "av1dec", "mpeg4": "avdec_mpeg4", "vp8": "avdec_vp8"}
_NVIDIA_CODECS = {"h264", "hevc", "vp9", "av1", "mpeg4", "vp8"}
_PULL_TIMEOUT_NS = 30 * 1_000_000_000

_gst = None
_gst_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size: int | None = None
_pool_lock = threading.Lock()


def gst():
    """GStreamer, initialised once; a clear error when its Python bindings are missing."""
    global _gst
    with _gst_lock:
        if _gst is None:
            _pin_cxx_unwinder()
            try:
                import gi

                gi.require_version("Gst", "1.0")
                from gi.repository import Gst
            except (ImportError, ValueError) as exc:
                raise ConfigError(
                    f"the deepstream backend needs GStreamer's Python bindings: {exc}",
                    hint="run `make setup` (installs python3-gi and python3-gst-1.0) or pick "
                         "another video backend", code="video_backend_unavailable") from None
            Gst.init(None)
            _gst = Gst
        return _gst


def _pin_cxx_unwinder() -> None:
    """Load libgcc_s globally before GStreamer, whose core links libunwind.

    libunwind also exports ``_Unwind_Resume``; if it wins symbol resolution, a C++ exception
    thrown later by another native decoder in this process (torchcodec on a corrupt file)
    cannot unwind and aborts the whole process instead of becoming a client error.
    """
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libgcc_s.so.1", mode=ctypes.RTLD_GLOBAL)


def has_element(name: str) -> bool:
    return gst().ElementFactory.find(name) is not None


def nvidia_available() -> bool:
    return has_element("nvv4l2decoder") and has_element("nvvideoconvert")


def worker_pool(size: int) -> ThreadPoolExecutor:
    """The process-wide decode pool; created with the first ``size`` asked for."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None:
            _pool, _pool_size = ThreadPoolExecutor(size, "aphrodite-deepstream"), size
        elif size != _pool_size:
            logger.warning("deepstream pool_size=%s ignored: the process-wide pool already has "
                           "%s workers (the first value wins)", size, _pool_size)
        return _pool


def pipeline_description(scan: ContainerScan, location: str, decoder: str) -> str:
    """The gst-launch description for this clip and decoder choice."""
    demux = _DEMUXERS.get(scan.container)
    if demux is None or scan.codec not in _SOFTWARE_DECODERS:
        raise UnsupportedMediaError(
            f"the deepstream backend cannot decode {scan.codec} in {scan.container}",
            hint="pick the opencv, pyav or torchcodec backend for this video")
    use_nvidia = decoder == "nvidia" or (decoder == "auto" and nvidia_available())
    if decoder == "nvidia" and not nvidia_available():
        raise ConfigError("deepstream decoder=nvidia needs the nvv4l2decoder and "
                          "nvvideoconvert GStreamer elements (NVIDIA DeepStream)",
                          hint='install DeepStream or use "decoder": "auto"/"software"',
                          code="video_backend_unavailable")
    parts = [f'filesrc location="{location}"', demux]
    if _PARSERS.get(scan.codec):
        parts.append(_PARSERS[scan.codec])
    if use_nvidia and scan.codec in _NVIDIA_CODECS:
        parts += ["nvv4l2decoder", "nvvideoconvert", "video/x-raw,format=RGBA"]
    else:
        parts.append(_SOFTWARE_DECODERS[scan.codec])
    if not scan.colorspace_tagged:
        # Untagged video: FFmpeg (every other backend, the CLI) converts with BT.601, while
        # GStreamer guesses BT.709 for HD sizes; say BT.601 so the colours agree.
        parts.append("capssetter caps=video/x-raw,colorimetry=bt601")
    parts += ["videoconvert", "videoflip video-direction=auto", "videoconvert",
              "video/x-raw,format=RGB", "appsink name=sink sync=false max-buffers=8"]
    return " ! ".join(parts)


def _buffer_to_array(sample) -> np.ndarray:
    Gst = gst()
    caps = sample.get_caps().get_structure(0)
    width, height = caps.get_value("width"), caps.get_value("height")
    buf = sample.get_buffer()
    ok, info = buf.map(Gst.MapFlags.READ)
    if not ok:
        raise MediaDecodeError("could not read a decoded frame", code="video_corrupt")
    try:
        stride = len(info.data) // height if height else 0
        rows = np.frombuffer(info.data, dtype=np.uint8, count=stride * height)
        return rows.reshape(height, stride)[:, : width * 3].reshape(height, width, 3).copy()
    finally:
        buf.unmap(info)


def run_pipeline(data: bytes, scan: ContainerScan, indices: list[int], decoder: str
                 ) -> list[np.ndarray]:
    """Decode the sampled frames through a GStreamer pipeline (blocking)."""
    Gst = gst()
    fd = os.memfd_create("aphrodite-video", os.MFD_CLOEXEC)
    pipeline = None
    try:
        os.write(fd, data)
        description = pipeline_description(scan, f"/proc/self/fd/{fd}", decoder)
        try:
            pipeline = Gst.parse_launch(description)
        except Exception as exc:  # GLib.Error: a missing element
            raise ConfigError(f"the deepstream pipeline could not be built: {sanitize(exc)}",
                              hint="run `make setup` to install GStreamer's plugins",
                              code="video_backend_unavailable") from None
        sink = pipeline.get_by_name("sink")
        bus = pipeline.get_bus()
        pipeline.set_state(Gst.State.PLAYING)
        # GStreamer keeps a frame that straddles an edit list's start (clipped); FFmpeg, whose
        # numbering every backend follows, drops it. Which one happened is known only at the
        # end (one frame more than the scan counted), so keep both candidates per index.
        keep = set(indices) | {i + 1 for i in indices}
        decoded: dict[int, np.ndarray] = {}
        count = 0
        while True:
            sample = sink.emit("try-pull-sample", _PULL_TIMEOUT_NS)
            if sample is None:
                message = bus.pop_filtered(Gst.MessageType.ERROR)
                if message is not None:
                    error, _debug = message.parse_error()
                    raise MediaDecodeError(f"the video could not be decoded: "
                                           f"{sanitize(error.message)}", code="video_corrupt")
                break  # end of stream
            if count in keep:
                decoded[count] = _buffer_to_array(sample)
            count += 1
            if count > scan.frame_count + 1:
                break  # more frames than the container holds: numbering cannot be trusted
        shift = 1 if count == scan.frame_count + 1 else 0
        frames = [decoded[i + shift] for i in indices if i + shift in decoded]
        return frames
    finally:
        if pipeline is not None:
            pipeline.set_state(Gst.State.NULL)
        os.close(fd)


class DeepStreamBackend(VideoBackend):
    name: ClassVar[str] = "deepstream"

    def decode(self, data: bytes, scan: ContainerScan, indices: list[int],
               options: DeepStreamOptions) -> np.ndarray:  # type: ignore[override]
        if not indices:
            return stack([], scan)
        pool = worker_pool(options.pool_size)
        frames = pool.submit(run_pipeline, data, scan, indices, options.decoder).result()
        return stack(frames, scan)


BACKEND = DeepStreamBackend()
