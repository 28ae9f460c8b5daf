"""The `aphrodite` command: wiring only. Each command group lives in its own module."""

from __future__ import annotations

import sys
import warnings
from typing import Annotated

import typer
import typer.core
import typer.rich_utils

from aphrodite_cli import media, model, serve
from aphrodite_cli.bench import cli as bench

# Piped into a file or a CI log, help would be laid out for 80 columns and cut flag names
# with "…": off a terminal (and unless TERMINAL_WIDTH says otherwise) it gets room.
if typer.rich_utils.MAX_WIDTH is None and not sys.stdout.isatty():
    typer.rich_utils.MAX_WIDTH = 200

# A flag takes no value, so help shows none (Typer writes "<bool>" in the value column, which
# reads as if --flag true were the syntax); other options keep their "<int>", "<path>"...
_display_type_rich = typer.core.TyperOption.display_type_rich


def _no_value_for_flags(self: typer.core.TyperOption, ctx) -> str | None:
    return None if self.is_flag and self.metavar is None else _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _no_value_for_flags  # type: ignore[method-assign]

app = typer.Typer(
    name="aphrodite",
    help="Serve and benchmark multimodal (image, video, audio) language models.\n\n"
    "Environment variables (APHRODITE_*) are listed in docs/environment.md; unknown ones are "
    "warned about.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(media.app, name="media")
app.add_typer(bench.app, name="bench")
app.add_typer(model.app, name="model")
app.command("serve", epilog=serve.EPILOG)(serve.serve)
app.command("run", epilog=serve.EPILOG, help="Alias of serve.")(serve.serve)


def _version(value: bool) -> None:
    if value:
        from engine.version import __version__

        typer.echo(f"aphrodite {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True,
                     help="Print the version and exit."),
    ] = False,
) -> None:
    """Serve and benchmark multimodal (image, video, audio) language models."""
    from engine import envs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs.warn_unknown()
    from aphrodite_cli.output import warn

    for item in caught:
        warn(str(item.message))
    envs.validate_all()


def main() -> None:
    """Console entry point: known errors become one line and an exit code."""
    from engine.errors import AphroditeError, ConfigError

    try:
        app(standalone_mode=True)
    except AphroditeError as error:
        from engine import envs

        try:
            debug = envs.APHRODITE_DEBUG
        except ConfigError:
            debug = False
        if debug:
            raise
        from aphrodite_cli.output import print_error

        print_error(error)
        sys.exit(2 if isinstance(error, ConfigError) else 1)


if __name__ == "__main__":
    main()
