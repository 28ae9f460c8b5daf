"""``aphrodite media ...``: look at media the way the server will."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import typer

from aphrodite_cli.bench.harness.synthetic_caps import MAX_FPS, MAX_FRAMES, MAX_SECONDS, MAX_SIDE
from aphrodite_cli.options import (
    DEFAULT_VIDEO_BACKEND,
    AllowedLocalMediaPath,
    AllowedMediaDomains,
    MediaIoKwargs,
    parse_json_flag,
    split_hosts,
)
from aphrodite_cli.output import out, print_json
from engine.media.video.backend_info import NAMES as VIDEO_BACKEND_NAMES
from engine.media.video.sampling import DEFAULT_NUM_FRAMES

app = typer.Typer(help="Inspect media exactly as `aphrodite serve` would fetch and decode it.",
                  no_args_is_help=True)

ModalityChoice = Literal["auto", "image", "video", "audio"]


@app.command(
    epilog="""Examples:

  aphrodite media probe https://example.com/cat.jpg

  aphrodite media probe file:///srv/media/clip.mp4 --allowed-local-media-path /srv/media

  aphrodite media probe "data:audio/wav;base64,UklGR..." --json

  echo "data:video/mp4;base64,$(base64 -w0 clip.mp4)" | aphrodite media probe -

Exit code 0 when the media would be accepted, 1 when it would be refused."""
)
def probe(
    source: Annotated[str, typer.Argument(
        help="http(s) URL, data: URL or file:// URL; '-' reads it from stdin (long data URLs).")],
    modality: Annotated[
        ModalityChoice,
        typer.Option("--modality", "-m",
                     help="Which content part it would be; auto guesses from the MIME type or "
                     "file extension."),
    ] = "auto",
    allowed_media_domains: AllowedMediaDomains = None,
    allowed_local_media_path: AllowedLocalMediaPath = None,
    sampling_rate: Annotated[
        int, typer.Option("--sampling-rate", min=1000, help="Audio rate sent to the model (Hz).")
    ] = 16_000,
    media_io_kwargs: MediaIoKwargs = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check, fetch and decode one media reference with the same policy flags as `serve`."""
    from engine.errors import AphroditeError, ConfigError

    if source == "-":
        import sys

        source = sys.stdin.read().strip()
    try:
        _probe(source, modality, allowed_media_domains, allowed_local_media_path,
               sampling_rate, media_io_kwargs, as_json)
    except AphroditeError as err:
        if not as_json:
            raise
        # --json prints JSON for every input: a refusal before probing (an unknown modality,
        # a bad flag) has the report's shape too.
        from engine.media.policy import display_url

        print_json({"source": display_url(source), "modality": None if modality == "auto"
                    else modality, "ok": False, "error": {
                        "status": err.status, "code": err.code, "type": err.type,
                        "message": err.message, "hint": err.hint}})
        raise typer.Exit(2 if isinstance(err, ConfigError) else 1) from None


def _probe(source: str, modality: str, allowed_media_domains, allowed_local_media_path,
           sampling_rate: int, media_io_kwargs, as_json: bool) -> None:
    from engine.config import MediaLimits, MediaPolicy
    from engine.media.probe import probe_source

    policy = MediaPolicy.create(
        allowed_domains=split_hosts(allowed_media_domains),
        allowed_local_path=allowed_local_media_path,
    )
    chosen = None if modality == "auto" else modality
    from engine.media.video.options import server_video_spec

    # checked once, here: a bad backend or option is a usage error, up front
    video = server_video_spec(parse_json_flag("--media-io-kwargs", media_io_kwargs))
    report = asyncio.run(
        probe_source(source, chosen, policy, MediaLimits.from_env(), sampling_rate=sampling_rate,
                     video=video)
    )
    if as_json:
        print_json(report.to_dict())
    else:
        _print_report(report)
    raise typer.Exit(0 if report.ok else 1)


def _print_report(report) -> None:
    status = "[green]accepted[/]" if report.ok else "[red]refused[/]"
    out.print(f"{report.modality} {report.source}: {status}", markup=True)
    rows = [("source", report.kind), ("mime", report.mime),
            ("declared mime", report.declared_mime), ("bytes", report.bytes),
            ("fetch time (s)", report.fetch_s)]
    rows += list(report.details.items())
    if report.sent_to_model:
        sent = ", ".join(f"{k}={v}" for k, v in report.sent_to_model.items()
                         if k != "sampled_indices")
        rows.append(("sent to model", sent))
    for key, value in rows:
        if isinstance(value, list) and len(value) > 8:
            value = f"{value[:4]} … {value[-2:]} ({len(value)})"
        if value is not None:
            out.print(f"  {key:<18} {value}", markup=False)
    if report.error:
        e = report.error
        out.print(f"  [red]HTTP {e['status']} {e['code']}:[/] {e['message']}", markup=True)
        if e.get("hint"):
            out.print(f"  hint: {e['hint']}", markup=False)


@app.command(
    epilog="""Examples:

  aphrodite media generate image cat.jpg --width 1280 --height 720

  aphrodite media generate video clip.mp4 --seconds 10 --width 1920 --height 1080 --gop 250

  aphrodite media generate audio tone.wav --seconds 3"""
)
def generate(
    kind: Annotated[Literal["image", "video", "audio"], typer.Argument(help="What to make.")],
    out_path: Annotated[str, typer.Argument(metavar="OUT", help="File to write.")],
    width: Annotated[int, typer.Option(min=1, max=MAX_SIDE, help="Image/video width.")] = 640,
    height: Annotated[int, typer.Option(min=1, max=MAX_SIDE,
                                        help="Image/video height.")] = 480,
    seconds: Annotated[float, typer.Option(
        min=0.05, max=MAX_SECONDS, help=f"Video/audio duration (a video at most {MAX_FRAMES} "
                                        "frames).")] = 2.0,
    fps: Annotated[int, typer.Option(min=1, max=MAX_FPS, help="Video frame rate.")] = 30,
    codec: Annotated[str, typer.Option(help="Video encoder (libx264, libx265, libvpx-vp9, "
                                       "libsvtav1).")] = "libx264",
    gop: Annotated[int, typer.Option(min=1, help="Video keyframe interval in frames.")] = 30,
    bframes: Annotated[int, typer.Option(min=0, help="Video B-frames (x264/x265).")] = 2,
    seed: Annotated[int, typer.Option(help="Content seed; same seed, same bytes.")] = 0,
) -> None:
    """Write synthetic media with structure and motion (every video frame distinct)."""
    from pathlib import Path

    from aphrodite_cli.bench.harness import synthetic
    from aphrodite_cli.bench.harness.synthetic_caps import check_seconds, check_size

    path = Path(out_path)
    suffix = path.suffix.lower().lstrip(".")
    if kind == "image":
        fmt = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF",
               "bmp": "BMP", "tif": "TIFF", "tiff": "TIFF"}.get(suffix, "JPEG")
        data = synthetic.make_image(width, height, fmt=fmt, seed=seed)
    elif kind == "video":
        check_seconds("--seconds", seconds, fps)
        check_size("--width/--height/--seconds", width, height, round(seconds * fps))
        container = {"mkv": "matroska", "webm": "webm", "mov": "mov"}.get(suffix, "mp4")
        data = synthetic.make_video(width=width, height=height, fps=fps, seconds=seconds,
                                    codec=codec, container=container, gop=gop,
                                    bframes=bframes, seed=seed)
    else:
        fmt = suffix if suffix in ("wav", "flac", "mp3", "ogg") else "wav"
        data = synthetic.make_audio(seconds=seconds, fmt=fmt)
    path.write_bytes(data)
    out.print(f"wrote {path} ({len(data)} bytes)", markup=False)


@app.command(
    epilog="""Examples:

  aphrodite media decode file:///srv/clip.mp4 --allowed-local-media-path /srv
  --backend pyav --out frames/

  aphrodite media decode https://example.com/clip.webm
  --backend torchcodec:seek_mode=approximate --num-frames 8 --out frames/

Writes frame_0000.png ... and decode.json (metadata and decode time) into OUT."""
)
def decode(
    source: Annotated[str, typer.Argument(help="http(s), data: or file:// URL of a video; "
                                          "'-' reads it from stdin.")],
    out_dir: Annotated[str, typer.Option("--out", help="Folder for the PNGs and decode.json.")],
    backend: Annotated[str, typer.Option(
        metavar="NAME[:KEY=VALUE...]", help=f"{', '.join(VIDEO_BACKEND_NAMES)}, with options "
        "after the name as in the benchmarks, e.g. pyav:threads=2 (default: "
        f"{DEFAULT_VIDEO_BACKEND})")] = "",
    num_frames: Annotated[int | None, typer.Option(
        min=1, help=f"Frames to sample (default {DEFAULT_NUM_FRAMES}).")] = None,
    fps: Annotated[float | None, typer.Option(min=0.001, help="Frames per second to sample.")
                   ] = None,
    max_duration: Annotated[float | None, typer.Option(
        min=0.001, help="Only sample the first N seconds.")] = None,
    options: Annotated[str | None, typer.Option(
        "--options", metavar="JSON", help="Backend options as JSON (the same as after the "
        "name in --backend), e.g. '{\"seek_mode\": \"approximate\"}' for torchcodec.")] = None,
    allowed_media_domains: AllowedMediaDomains = None,
    allowed_local_media_path: AllowedLocalMediaPath = None,
) -> None:
    """Decode a video's sampled frames with one backend and write them as PNG."""
    import json
    import sys
    from pathlib import Path

    from PIL import Image

    from engine.config import MediaLimits, MediaPolicy
    from engine.errors import AphroditeError
    from engine.media.connector import MediaConnector
    from engine.media.video import load_video
    from engine.media.video.options import parse_backend_choice, server_video_spec

    if source == "-":
        source = sys.stdin.read().strip()
    video = dict(parse_json_flag("--options", options) or {})
    if backend:
        video.update(parse_backend_choice(backend, flag="--backend"))
    for key, value in (("num_frames", num_frames), ("fps", fps), ("max_duration", max_duration)):
        if value is not None:
            video[key] = value
    spec = server_video_spec({"video": video})
    policy = MediaPolicy.create(allowed_domains=split_hosts(allowed_media_domains),
                                allowed_local_path=allowed_local_media_path)
    limits = MediaLimits.from_env()

    async def fetch() -> bytes:
        async with MediaConnector(policy, limits) as connector:
            return (await connector.load_bytes(source, "video")).data

    try:
        result = load_video(asyncio.run(fetch()), spec, limits)
    except AphroditeError as err:
        from aphrodite_cli.output import print_error

        print_error(err)
        raise typer.Exit(1) from None
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for n, frame in enumerate(result.frames):
        Image.fromarray(frame).save(folder / f"frame_{n:04d}.png")
    meta = {**result.metadata.__dict__, "options": spec.options.__dict__,
            "sampling": spec.sampling.__dict__, "source": source[:200]}
    (folder / "decode.json").write_text(json.dumps(meta, indent=2) + "\n")
    out.print(f"{result.frames.shape[0]} frames {result.metadata.width}x"
              f"{result.metadata.height} via {spec.backend} in {result.metadata.decode_s:.3f} s "
              f"-> {folder}", markup=False)
