"""Result files: one JSON per run, with the environment it ran in; the one place that knows
each kind's schema version, and the one loader (gate, report, soak baseline) that refuses a
file of another kind or version with a clear error instead of reading it wrong."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from aphrodite_cli.bench.results import environment
from aphrodite_cli.bench.results.models import MODELS
from engine.errors import ConfigError

DEFAULT_DIR = Path("results")
#: the largest result file read (a serve run of a million requests writes about 100 MB)
MAX_RESULT_BYTES = 256 << 20

#: kind -> the schema version this code writes and reads (each kind's model holds it)
SCHEMA_VERSIONS: dict[str, int] = {kind: model.VERSION for kind, model in MODELS.items()}


def stamp(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """``doc`` with its kind and that kind's schema version first."""
    return {"schema_version": SCHEMA_VERSIONS[kind], "kind": kind,
            **{k: v for k, v in doc.items() if k not in ("schema_version", "kind")}}


def write_result(doc: dict[str, Any], kind: str, out_dir: Path | None = None, *,
                 filename: str | None = None) -> Path:
    """``results/<kind>-<UTC timestamp>.json`` (or under ``out_dir``; ``filename``: that
    name instead, as vLLM's --result-filename)."""
    folder = out_dir or DEFAULT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    doc = {**stamp(doc, kind), "environment": environment.capture(),
           "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(doc, indent=2, default=str) + "\n"
    MODELS[kind].model_validate(json.loads(text))  # never write a file readers would refuse
    if filename:
        path = folder / Path(filename).name
    else:
        path = folder / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{n}.json"
    path.write_text(text)
    return path


def load_result(path: Path, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A result file of one of ``kinds`` (any known kind when None) at the schema version
    this code reads; anything else is a ConfigError naming the file and what it holds."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_RESULT_BYTES:
            raise ConfigError(f"{path} holds {size} bytes, past the {MAX_RESULT_BYTES >> 20} MB "
                              "a result file may hold", hint="a bench command writes far less; "
                              "pass the files it wrote", code="result_too_large")
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read result file {path}: {exc.strerror or exc}",
                          code="result_unreadable") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start})",
                          hint="pass a file that an aphrodite bench command wrote",
                          code="result_unreadable") from None
    except (ValueError, RecursionError):
        raise ConfigError(f"{path} is not JSON", hint="pass a file that an aphrodite bench "
                          "command wrote", code="result_unreadable") from None
    kind = doc.get("kind") if isinstance(doc, dict) else None
    wanted = kinds or tuple(SCHEMA_VERSIONS)
    if kind not in wanted:
        raise ConfigError(f"{path} is {'a ' + repr(kind) if kind else 'not an aphrodite'} "
                          f"result, not {' or '.join(wanted)}",
                          hint="pass a file that the matching aphrodite bench command wrote",
                          code="result_wrong_kind")
    version = doc.get("schema_version")
    if version in UPGRADES.get(kind, {}):
        doc = upgrade(doc, kind)
        version = doc["schema_version"]
    if version != SCHEMA_VERSIONS[kind]:
        raise ConfigError(f"{path} is a {kind} result of schema version {version}; this "
                          f"aphrodite reads version {SCHEMA_VERSIONS[kind]}",
                          hint="re-run the benchmark with this version, or compare it with "
                               "the aphrodite version that wrote it", code="result_old_schema")
    check_fields(doc, kind, path)
    return doc


def _stage_names_in_ms(stages: object) -> object:
    """Version 1 named server stages holding milliseconds ``*_s``: ``decode_s`` ->
    ``decode_ms``."""
    if not isinstance(stages, dict):
        return stages
    return {(k.removesuffix("_s") + "_ms" if isinstance(k, str) and k.endswith("_s") else k): v
            for k, v in stages.items()}


def _serve_phase_v1(phase: object) -> None:
    if not isinstance(phase, dict):
        return
    if "server_stages_ms" in phase:
        phase["server_stages_ms"] = _stage_names_in_ms(phase["server_stages_ms"])
    samples = phase.get("samples")
    if isinstance(samples, dict) and "stages_ms" in samples:
        samples["stages_ms"] = _stage_names_in_ms(samples["stages_ms"])


def _serve_v1(doc: dict[str, Any]) -> None:
    phases = doc.get("phases")
    for phase in phases.values() if isinstance(phases, dict) else ():
        _serve_phase_v1(phase)


def _sweep_v1(doc: dict[str, Any]) -> None:
    phases = doc.get("phases")
    for phase in phases.values() if isinstance(phases, dict) else ():
        capacity = phase.get("capacity") if isinstance(phase, dict) else None
        if isinstance(capacity, dict):
            # version 1's capacity was the offered rate of the best point (version 2: the
            # rate served through it, never higher): said, so the gate does not compare them
            capacity["definition"] = "offered"
        points = phase.get("points") if isinstance(phase, dict) else None
        for point in points if isinstance(points, list) else ():
            if isinstance(point, dict):
                _serve_phase_v1(point.get("result"))


#: kind -> {an older schema version: what turns it into the next one}: files written by an
#: older aphrodite are read, not refused, where the change was a rename
UPGRADES: dict[str, dict[int, Any]] = {"serve": {1: _serve_v1}, "sweep": {1: _sweep_v1}}


def upgrade(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """``doc`` brought to this code's schema version, one version at a time; the version it
    was written in is kept as ``upgraded_from``."""
    doc = json.loads(json.dumps(doc))  # a copy: the caller's document stays as read
    written = doc.get("schema_version")
    while (step := UPGRADES.get(kind, {}).get(doc.get("schema_version"))) is not None:
        step(doc)
        doc["schema_version"] += 1
    doc["upgraded_from"] = written
    return doc


def check_fields(doc: dict[str, Any], kind: str, path: Path | str) -> None:
    """``doc`` against its kind's model (:mod:`aphrodite_cli.bench.results.models`): a field a
    reader relies on missing or of another type is a ConfigError naming it."""
    try:
        MODELS[kind].model_validate(doc)
    except ValidationError as exc:
        # a union's member names ("list[constrained-float]") are pydantic's, not the file's;
        # of a union's errors, the one that reached deepest into the file is the one to name
        found = [(tuple(p for p in e["loc"] if not (isinstance(p, str) and "[" in p)),
                  e["msg"]) for e in exc.errors()]
        found = [(loc, msg) for loc, msg in found if not any(
            len(other) > len(loc) and other[:len(loc)] == loc for other, _ in found)]
        problems = [".".join(str(p) for p in loc) + f" ({msg})" if loc else msg
                    for loc, msg in found[:5]]
        raise ConfigError(f"{path} is a {kind} result with {'; '.join(problems)}: it was cut "
                          "short or edited", hint="re-run the benchmark that wrote it",
                          code="result_incomplete") from None
