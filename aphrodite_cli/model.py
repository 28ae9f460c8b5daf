"""``aphrodite model ...``: the model registry and tiny test models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.options import OUTPUT_FORMAT_HELP, ModelSizeName, OutputFormat
from aphrodite_cli.output import out, print_table

app = typer.Typer(help="Registered model families and tiny random-weight models.",
                  no_args_is_help=True)


@app.command("list")
def list_models(
    output_format: Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)] = "table",
) -> None:
    """The registered families: modalities, items per prompt, chat template, and the
    processor kwargs each adds to the common ones (for --mm-processor-kwargs)."""
    from engine.models.registry import REGISTRY
    from engine.processing.kwargs import family_kwargs

    print_table("registered model families",
                ["family", "HF class", "modalities (max items)", "chat template",
                 "own processor kwargs"],
                [[spec.name, spec.model_class,
                  ", ".join(f"{m} ({n})" for m, n in spec.max_items.items()),
                  "ships one" if spec.ships_chat_template else "none: --chat-template",
                  ", ".join(family_kwargs(spec)) or "-"]
                 for spec in REGISTRY.values()], output_format)
    if output_format == "table":
        out.print("Every family also takes the common ones: size, do_resize, do_rescale, "
                  "do_normalize, image_mean, image_std, resample; videos fps, num_frames; "
                  "audio sampling_rate, max_length.", markup=False)


@app.command(
    "make-tiny",
    epilog="""Examples:

  aphrodite model make-tiny qwen2_5_vl --out /tmp/tiny-qwen

  aphrodite model make-tiny llava --out /tmp/tiny-llava --seed 1

  aphrodite model make-tiny qwen2_5_vl --head-dim 16 --out /tmp/tiny-like-tests

  aphrodite model make-tiny qwen2_5_vl --size medium --out /tmp/medium-qwen   # ~150 M""",
)
def make_tiny(
    arch: Annotated[str, typer.Argument(help="A registered family (aphrodite model list).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write the model into.")],
    seed: Annotated[int, typer.Option(help="Weight seed; same seed, same weights.")] = 0,
    head_dim: Annotated[int | None, typer.Option(
        min=8, help="Attention head size of the text model (even; the width follows: 4 heads "
                    "x head_dim), e.g. 64. 32 by default because vLLM's CPU attention refuses "
                    "16 (it takes 32, 64, 80 and up); the cached tiny:ARCH models the tests "
                    "serve use 16. --size small/medium have 64.")] = None,
    size: Annotated[ModelSizeName, typer.Option(
        help="tiny (the default), or small (~43 M parameters) / medium (~150 M) for "
             "measuring how cost grows with the model (qwen2_5_vl; head_dim 64).")] = "tiny",
) -> None:
    """Build a tiny random-weight instance of a family (real config and processor classes)."""
    import time

    from engine.models.registry import get_arch
    from engine.models.tiny import build_tiny

    spec = get_arch(arch)
    start = time.perf_counter()
    if head_dim is None and size == "tiny":
        head_dim = 32
    build_tiny(spec.name, out_dir, seed, head_dim=head_dim, size=size)
    out.print(f"built {size} {spec.name} (head_dim {head_dim or 64}) in "
              f"{time.perf_counter() - start:.1f} s -> {out_dir}", markup=False)


@app.command(
    "download",
    epilog="""Examples:

  aphrodite model download Qwen/Qwen2.5-VL-3B-Instruct

  aphrodite model download Qwen/Qwen2.5-VL-3B-Instruct --no-weights   # processor files only

  HF_ENDPOINT=https://hf-mirror.example aphrodite model download org/name --revision v1""",
)
def download(
    repo_id: Annotated[str, typer.Argument(help="A Hugging Face Hub id, e.g. org/name.")],
    revision: Annotated[str | None, typer.Option(
        help="Branch, tag or commit, e.g. main.")] = None,
    download_dir: Annotated[str | None, typer.Option(
        help="Folder to download into instead of the Hugging Face cache.")] = None,
    weights: Annotated[bool, typer.Option(
        help="Also fetch the weights (safetensors; .bin only for a repo without any); "
             "--no-weights fetches configs, tokenizer, processor and chat template only, "
             "enough for bench mm-processor.")] = True,
) -> None:
    """Download a model into the Hugging Face cache (as serve does on first use) and print
    its folder and family."""
    import json

    from engine.errors import ConfigError
    from engine.models import hub
    from engine.models.registry import arch_for_config

    if not hub.is_hub_id(repo_id):
        raise ConfigError(f"{repo_id!r} is not a Hugging Face Hub id",
                          hint="pass it as org/name", code="model_not_found")
    folder = hub.download(repo_id, revision=revision, download_dir=download_dir,
                          weights=weights)
    config_file = folder / "config.json"
    family = "?"
    if config_file.is_file():
        try:
            family = arch_for_config(json.loads(config_file.read_text()), repo_id).name
        except ConfigError as err:
            family = f"not supported here ({err.message})"
    out.print(f"{repo_id} -> {folder} (family: {family})", markup=False)
