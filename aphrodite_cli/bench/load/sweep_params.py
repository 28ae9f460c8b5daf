"""``bench sweep serve``'s parameter sets (vLLM's ``--serve-params`` / ``--bench-params``): a
JSON list of objects, given inline or as a file, each object one set of flags
(``{"max_num_seqs": 8}`` is ``--max-num-seqs 8``), and the flags a set becomes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

#: A parameter's name: a flag without its dashes, in vLLM's underscores or in dashes.
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
#: At most this many sets per list (a sweep of more is a typo, not a plan).
MAX_SETS = 1000


def parse_params(text: str | None, flag: str, *, reserved: frozenset[str] = frozenset()
                 ) -> list[dict[str, Any]]:
    """``text`` (JSON, or the path of a JSON file) as a list of parameter sets; None or
    absent: one empty set (the command as given). ``reserved``: flags the sweep sets itself,
    refused here."""
    if text is None:
        return [{}]
    source = text
    if not text.lstrip().startswith(("[", "{")):
        try:
            source = Path(text).read_text()
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(f"{flag} {text[:80]!r} is neither a JSON list nor a readable "
                              f"file ({why})", hint=f"{flag} '[{{\"max_num_seqs\": 8}}]' or "
                              f"{flag} params.json", code="invalid_flag") from None
    try:
        value = json.loads(source)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not JSON ({getattr(exc, 'msg', exc)}, line "
                          f"{getattr(exc, 'lineno', '?')} column {getattr(exc, 'colno', '?')})",
                          code="invalid_flag") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        got = type(value).__name__ if not isinstance(value, list) else (
            "an empty list" if not value else "a list holding " + ", ".join(sorted(
                {type(v).__name__ for v in value if not isinstance(v, dict)})))
        raise ConfigError(f"{flag} must be a JSON list of objects (flag name -> value), got "
                          f"{got}", hint=f"e.g. {flag} '[{{\"max_num_seqs\": 8}}, "
                          f"{{\"max_num_seqs\": 16}}]'", code="invalid_flag")
    if len(value) > MAX_SETS:
        raise ConfigError(f"{flag} holds {len(value)} sets, more than {MAX_SETS}",
                          code="invalid_flag")
    for n, params in enumerate(value):
        for key, item in params.items():
            where = f"{flag} set #{n} {json.dumps(params)[:120]}"
            if not NAME.fullmatch(key):
                raise ConfigError(f"{where}: {key[:40]!r} is not a flag name (letters, digits, "
                                  "_ and -)", code="invalid_flag")
            if flag_name(key) in reserved:
                raise ConfigError(f"{where}: {flag_name(key)} is set by the sweep itself",
                                  hint="leave it out of the parameters", code="invalid_flag")
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{where}: {key} is not a finite number", code="invalid_flag")
    return value


def flag_name(key: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + key.replace("_", "-")


def as_flags(params: dict[str, Any]) -> list[str]:
    """A parameter set as command-line flags: ``true`` is the bare flag, ``false`` its
    ``--no-`` form, ``null`` leaves it out, a list repeats it, an object is its JSON."""
    argv: list[str] = []
    for key, value in params.items():
        flag = flag_name(key)
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                argv += [flag, item if isinstance(item, str) else json.dumps(item)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def last_error(output: str) -> str:
    """The one line a failed command's output says what went wrong in: the text of Typer's
    error box, else the last ``Error:`` line, else the last non-empty line."""
    lines = output.splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].lstrip().startswith("╭─ Error"):
            body = []
            for line in lines[start + 1:]:
                if line.lstrip().startswith("╰"):
                    break
                body.append(line.strip().strip("│").strip())
            return " ".join(b for b in body if b)
    for line in reversed(lines):
        if line.strip().startswith(("Error:", "error:")):
            return line.strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
