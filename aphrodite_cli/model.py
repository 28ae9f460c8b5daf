"""``aphrodite model ...``: the model registry and tiny test models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.output import out

app = typer.Typer(help="Registered model families and tiny random-weight models.",
                  no_args_is_help=True)


@app.command("list")
def list_models() -> None:
    """The registered families: modalities, items per prompt, chat template."""
    from rich.table import Table

    from engine.models.registry import REGISTRY

    table = Table()
    for col in ("family", "HF class", "modalities (max items)", "chat template"):
        table.add_column(col)
    for spec in REGISTRY.values():
        mods = ", ".join(f"{m} ({n})" for m, n in spec.max_items.items())
        table.add_row(spec.name, spec.model_class, mods,
                      "ships one" if spec.ships_chat_template else "none: --chat-template")
    out.print(table)


@app.command(
    "make-tiny",
    epilog="""Examples:

  aphrodite model make-tiny qwen2_5_vl --out /tmp/tiny-qwen

  aphrodite model make-tiny llava --out /tmp/tiny-llava --seed 1""",
)
def make_tiny(
    arch: Annotated[str, typer.Argument(help="A registered family (aphrodite model list).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write the model into.")],
    seed: Annotated[int, typer.Option(help="Weight seed; same seed, same weights.")] = 0,
) -> None:
    """Build a tiny random-weight instance of a family (real config and processor classes)."""
    import time

    from engine.models.loader import offline
    from engine.models.registry import get_arch

    spec = get_arch(arch)
    offline()
    start = time.perf_counter()
    spec.build_tiny(out_dir, seed)
    out.print(f"built tiny {spec.name} in {time.perf_counter() - start:.1f} s -> {out_dir}",
              markup=False)
