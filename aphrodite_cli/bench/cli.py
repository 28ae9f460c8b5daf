"""``aphrodite bench ...`` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.output import out

app = typer.Typer(help="Benchmarks that write result files.", no_args_is_help=True)

DEFAULT_BACKENDS = "opencv,pyav,pyav:skip_nonref=false,torchcodec,deepstream"


def parse_backend_list(text: str) -> list[tuple[str, dict]]:
    """``pyav:threads=2:skip_nonref=false,opencv`` -> [("pyav", {...}), ("opencv", {})]."""
    backends = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, *opts = item.split(":")
        options = {}
        for opt in opts:
            key, _, raw = opt.partition("=")
            try:
                options[key] = json.loads(raw)
            except json.JSONDecodeError:
                options[key] = raw
        backends.append((name, options))
    return backends


@app.command(
    "video-decode",
    epilog="""Examples:

  aphrodite bench video-decode                      # the standard 10 s 1080p30 H.264 clip

  aphrodite bench video-decode clip.mp4 --backends pyav,torchcodec:seek_mode=approximate

Backend options follow the name: NAME:KEY=VALUE:KEY=VALUE.""",
)
def video_decode(
    clip: Annotated[Path | None, typer.Argument(help="Video file; default: the standard clip, "
                                                "generated once into the cache.")] = None,
    backends: Annotated[str, typer.Option(help="Comma-separated backends with options.")
                        ] = DEFAULT_BACKENDS,
    num_frames: Annotated[int, typer.Option(min=1, help="Frames sampled per decode.")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats of everything.")] = 5,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the result JSON goes.")
                       ] = Path("results"),
) -> None:
    """Time sampled decoding per backend against a full ffmpeg decode of the same clip."""
    from aphrodite_cli.bench import video_decode as runner
    from aphrodite_cli.bench.results import write_result

    path = clip or runner.standard_clip()
    doc = runner.run(path, parse_backend_list(backends), num_frames=num_frames,
                     repeats=repeats, progress=lambda msg: out.print(f"  {msg}", markup=False))
    result = write_result(doc, "video-decode", out_dir)
    _print_table(doc)
    out.print(f"result: {result}", markup=False)


def _print_table(doc: dict) -> None:
    from rich.table import Table

    clip = doc["clip"]
    table = Table(title=f"{clip['width']}x{clip['height']} {clip['codec']}, {clip['frames']} "
                  f"frames {clip['frame_types']}, {doc['num_frames']} sampled")
    for col in ("backend", "options", "median s", "x full decode", "frames exact", "error"):
        table.add_column(col)
    ref = doc["reference"]
    if ref["median_s"] is not None:
        table.add_row("ffmpeg (full decode)", "-threads 2", f"{ref['median_s']:.3f}", "1.00",
                      "", "")
    for b in doc["backends"]:
        ratio = b["ratio_to_full_decode"]
        table.add_row(b["backend"], json.dumps(b["options"]) if b["options"] else "",
                      f"{b['median_s']:.3f}" if b["median_s"] is not None else "-",
                      f"{ratio:.2f}" if ratio is not None else "-",
                      {True: "yes", None: "-",
                       False: f"no (mean diff {b['mean_abs_diff']})"}[b["identical_to_exact"]],
                      (b["error"] or "")[:60])
    out.print(table)
