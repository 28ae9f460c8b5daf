"""Command-line options generated from config fields (:func:`engine.settings.setting`): each
field's flag, help, default and ``--help`` panel are read from the field, so a new setting is
one field (and the code that uses it). Values are checked by the config object itself when it
is built (:func:`engine.settings.check`), not by Typer: one rule, one error, naming the flag.
A field with ``choices`` shows them as Typer shows a choice (``<auto|float32|...>``) and is
read as text, so a bad value is that same error (the flag, the value and the choices), not
Typer's own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from engine.settings import field_of, flag_of, settings


def _panel(cls: type, f: dataclasses.Field) -> str:
    return f.metadata.get("panel") or getattr(cls, "PANEL", "Options")


def choices_metavar(choices: Sequence[Any]) -> str:
    """How ``--help`` shows a choice flag's value: as Typer shows a ``Literal`` (``<a|b|c>``)."""
    return "<" + "|".join(str(c) for c in choices) + ">"


def option(cls: type, name: str, kind: Any = None, *decls: str, **overrides: Any) -> Any:
    """``Annotated[kind, typer.Option(...)]`` for the field ``name`` of ``cls``: its flag,
    help and panel from the field; ``kind`` (default: the field's type) and ``overrides``
    (e.g. ``parser``) for a flag whose text becomes the value through parsing. A field with
    text ``choices`` is read as text (checked by the config, not Typer) and shows them."""
    f = field_of(cls, name)
    meta = f.metadata
    flag = flag_of(f)
    choices = meta.get("choices")
    textual = choices is not None and all(isinstance(c, str) for c in choices)
    if kind is None and textual:
        kind = str | None if f.default is None else str
    if kind is None:
        kind = f.type if not isinstance(f.type, str) else \
            eval(f.type, vars(sys.modules[cls.__module__]))  # (the field's own annotation)
    if not decls:
        named = meta.get("flag") or meta.get("aliases") or not meta.get("negatable", True)
        decls = (flag, *meta.get("aliases", ())) if named else ()
    settings_ = {"help": meta["help"], "rich_help_panel": _panel(cls, f)}
    if meta.get("metavar"):
        settings_["metavar"] = meta["metavar"]
    elif textual:
        settings_["metavar"] = choices_metavar(choices)
    settings_.update(overrides)
    return Annotated[kind, typer.Option(*decls, **settings_)]


def with_config_flags(*classes: type, panels: tuple[str, ...] = ()
                      ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the command ``func`` an option for every command-line setting of ``classes`` that
    it does not declare itself (those it declares, by the field's name, take their help from
    :func:`option`). ``func`` is called with its own parameters and ``flags``: the generated
    values by class, ``{ServerConfig: {"port": 2242, ...}, ...}``, to build the objects from.
    ``panels``: the order of ``--help``'s panels (others after them)."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)
        params = [p for p in own.parameters.values() if p.name != "flags"]
        taken = {p.name for p in params}
        owner: dict[str, type] = {}
        for cls in classes:
            for f in settings(cls):
                if not f.metadata["cli"] or f.name in taken or f.name in owner:
                    continue
                owner[f.name] = cls
                params.append(inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                    annotation=option(cls, f.name)))

        def place(p: inspect.Parameter) -> int:
            info = typing.get_args(p.annotation)[1:] if typing.get_args(p.annotation) else ()
            panel = getattr(info[0], "rich_help_panel", None) if info else None
            return panels.index(panel) if panel in panels else len(panels)

        params.sort(key=lambda p: (p.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD
                                   or p.default is not inspect.Parameter.empty, place(p)))
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                  if p.default is not inspect.Parameter.empty else p for p in params]

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            flags: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
            for name, cls in owner.items():
                flags[cls][name] = values.pop(name)
            return func(**values, flags=flags)

        del command.__wrapped__  # Typer reads the signature below, not func's
        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.generated = owner  # type: ignore[attr-defined]
        return command

    return wrap


def in_panel(annotated: Any, panel: str) -> Any:
    """A shared ``Annotated[kind, typer.Option(...)]`` (``aphrodite_cli.options``) shown in
    ``panel`` of this command's help."""
    kind, info = typing.get_args(annotated)
    info = copy.copy(info)
    info.rich_help_panel = panel
    return Annotated[kind, info]
