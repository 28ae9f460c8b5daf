"""Fields of a dataset or trace row, read strictly: a JSON number that is not finite (Python's
json reads ``NaN`` and ``Infinity``), out of range, or a boolean (``true`` is not 1) is a
one-line :class:`~engine.errors.ConfigError` naming the file, the row and the field, never a
traceback, a run that never ends (an arrival a million years away) or a value taken as
another."""

from __future__ import annotations

import json
import math
from typing import Any

from engine.errors import ConfigError

#: the latest arrival a trace may schedule, in seconds after its first request (a week)
MAX_TRACE_SPAN_S = 7 * 86400.0
#: the largest arrival time read, in seconds (a clock reading since 1970 is far below it)
MAX_CLOCK = 1e12
#: the most output tokens a row may ask for
MAX_OUTPUT_TOKENS = 1 << 20


def shown(value: Any) -> str:
    """``value`` as the row wrote it, cut short for an error line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text[:40]


def whole(value: Any, where: str, name: str, low: int, high: int) -> int:
    """An integer from ``low`` to ``high`` (not a boolean, a float or a string)."""
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(f"{where}: {name} is a whole number from {low} to {high}, not "
                          f"{shown(value)}", code="invalid_dataset")
    return value


def number(value: Any, where: str, name: str, low: float, high: float) -> float:
    """A finite number from ``low`` to ``high`` (not a boolean or a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{where}: {name} is a finite number from {low:g} to {high:g}, not "
                          f"{shown(value)}", code="invalid_dataset")
    return float(value)


def text(value: Any, where: str, name: str) -> str:
    """A string."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {name} is a string, not {shown(value)}",
                          code="invalid_dataset")
    return value


def check_span(path: object, first_s: float, last_s: float) -> None:
    """A trace's replay must end: its last request at most :data:`MAX_TRACE_SPAN_S` after its
    first (in replay seconds)."""
    if not last_s - first_s <= MAX_TRACE_SPAN_S:
        raise ConfigError(f"the trace {path} spans {last_s - first_s:.4g} s from its first "
                          f"request to its last, past the cap of {MAX_TRACE_SPAN_S:g} s (a week)",
                          hint="check the arrival unit (arrival_s in seconds, timestamp in "
                               "ms) or the time scale flags", code="invalid_dataset")
