"""A setting declared once: a config dataclass field whose metadata holds its flag, its help and
its rule (bounds, choices). The ``serve`` flags are generated from these fields
(``aphrodite_cli/config_flags.py``: help, default, panel), and :func:`check` holds every value
to its rule in one place, wherever the object is built (the flags, ``LLM(...)``, a test), with
an error naming the flag.

Stdlib only (and :mod:`engine.errors`): the config modules import it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import ConfigError

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, *, help: str, flag: str | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            choices: Sequence[Any] | None = None, example: str | None = None,
            panel: str | None = None, cli: bool = True, negatable: bool = True,
            metavar: str | None = None, aliases: tuple[str, ...] = (),
            code: str = "invalid_flag",
            default_factory: Callable[[], Any] = _MISSING) -> Any:
    """A dataclass field with its flag's declaration in ``metadata``.

    ``flag``: the option's name when it is not ``--`` plus the field's name with dashes.
    ``ge``/``gt``/``le``: numeric bounds (a whole number when the field's type is ``int``);
    ``choices``: the values accepted; ``None`` is accepted whenever the default is None
    (unset). ``example``: a value shown in the error's hint. ``panel``: the ``serve --help``
    panel when not the class's ``PANEL``. ``cli=False``: checked, but no flag (set by code).
    ``negatable=False``: a boolean flag without its ``--no-`` form. ``metavar``: the value
    as ``--help`` shows it (default: the type's, or ``<a|b|c>`` for text ``choices``).
    ``aliases``: short forms, e.g. ``("-q",)``. ``code``: the error's code."""
    metadata = {"help": help, "flag": flag, "ge": ge, "gt": gt, "le": le,
                "choices": tuple(choices) if choices is not None else None,
                "example": example, "panel": panel, "cli": cli, "negatable": negatable,
                "metavar": metavar, "aliases": tuple(aliases), "code": code}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_setting(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def flag_of(f: dataclasses.Field) -> str:
    """The field's flag: declared, or ``--`` and its name with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def settings(cls: type) -> list[dataclasses.Field]:
    """The declared settings of a config dataclass, in order."""
    return [f for f in dataclasses.fields(cls) if is_setting(f)]


def field_of(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name}")


def _kind(f: dataclasses.Field) -> str:
    """``bool``, ``int``, ``float`` (the field's one type, or it or None) or ``other``."""
    types = [t.strip() for t in str(f.type).split("|") if t.strip() != "None"]
    return types[0] if len(types) == 1 and types[0] in ("bool", "int", "float") else "other"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _bounds(meta: dataclasses.Field) -> str:
    ge, gt, le = meta.metadata["ge"], meta.metadata["gt"], meta.metadata["le"]
    parts = []
    if ge is not None:
        parts.append(f"of at least {_number(ge)}")
    if gt is not None:
        parts.append(f"greater than {_number(gt)}")
    if le is not None:
        parts.append(f"at most {_number(le)}")
    return " and ".join(parts)


def problem(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with ``value`` for the setting ``f`` (None: nothing)."""
    meta = f.metadata
    if value is None and f.default is None:
        return None
    kind = _kind(f)
    if kind == "bool" and not isinstance(value, bool):
        return "must be true or false"
    numeric = any(meta[k] is not None for k in ("ge", "gt", "le"))
    if numeric or kind in ("int", "float"):
        whole = kind == "int"
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float) \
                or (not whole and math.isnan(value)):
            return f"must be a {'whole ' if whole else ''}number" + (
                f" {_bounds(f)}" if numeric else "")
        if (meta["ge"] is not None and value < meta["ge"]) or \
                (meta["gt"] is not None and value <= meta["gt"]) or \
                (meta["le"] is not None and value > meta["le"]):
            return f"must be a {'whole ' if whole else ''}number {_bounds(f)}"
    choices = meta["choices"]
    if choices is not None and value not in choices:
        return "is not supported"
    return None


def check(obj: Any) -> None:
    """Hold each declared setting of the dataclass ``obj`` to its rule: the first that breaks
    it is a :class:`ConfigError` naming its flag, the value and an example."""
    for f in settings(type(obj)):
        value = getattr(obj, f.name)
        what = problem(f, value)
        if what is None:
            continue
        flag, meta = flag_of(f), f.metadata
        if meta["choices"] is not None and what == "is not supported":
            message = f"{flag} {value!r} is not supported"
            hint = f"use one of {', '.join(str(c) for c in meta['choices'])}"
        else:
            message = f"{flag} {what}, not {value!r}"
            hint = f"e.g. {flag} {meta['example']}" if meta["example"] else \
                f"see {flag} in aphrodite serve --help"
        if f.default is None:
            hint += " (or leave it out)"
        raise ConfigError(message, hint=hint, code=meta["code"])
