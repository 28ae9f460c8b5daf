"""Public datasets by name (vLLM's ``--dataset-name hf`` and ``sharegpt``), read through the
Hugging Face ``datasets`` library, imported here only when such a dataset is asked for.

``--dataset-name hf --dataset-path ORG/NAME`` reads ``--hf-split`` (default train) of the
``--hf-subset`` configuration, streamed as vLLM reads it (only the rows used are read;
``--no-stream`` downloads the split into the ``datasets`` cache first: ``HF_HOME`` /
``HF_DATASETS_CACHE``, the libraries' own variables, as are ``HF_ENDPOINT`` and
``HF_TOKEN``). ``--dataset-name sharegpt`` reads a local JSON file (a list of rows, or JSON
lines) or a Hub id the same way, and takes rows with ``conversations`` only.

Rows are taken in the dataset's order (vLLM's ``--disable-shuffle``), ``--num-prompts`` of
them, repeated from the start when the split holds fewer. Each row is mapped by the first
schema of :mod:`~aphrodite_cli.bench.load.hub_schemas` whose columns it has; none: a
one-line error naming the columns the dataset has. Media are read undecoded (the bytes the
dataset holds are the bytes sent).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from aphrodite_cli.bench.data.datasets import BenchRequest
from aphrodite_cli.bench.data.media_files import read_lines
from aphrodite_cli.bench.load.hub_schemas import find_schema, to_request, unknown_schema
from engine.errors import ConfigError


@dataclass(frozen=True)
class HubArgs:
    """``--hf-split``, ``--hf-subset``, ``--hf-output-len`` (None: ``--output-len``) and
    ``--no-stream``."""

    split: str = "train"
    subset: str | None = None
    output_len: int | None = None
    stream: bool = True


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _hub_rows(path: str, hub: HubArgs, limit: int) -> tuple[list[dict], list[str]]:
    """The first ``limit`` rows of the split, media undecoded, and the split's columns."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("--dataset-name hf reads Hub datasets with Hugging Face's datasets "
                          "library, which is not installed", hint="pip install "
                          "datasets==5.2.0", code="invalid_flag") from None
    # A streamed split hands its state to torch's workers when torch is installed, importing
    # it (~4 s here) for nothing: the rows are read in this process alone.
    datasets.config.TORCH_AVAILABLE = False
    data = rows_iter = None
    try:
        data = datasets.load_dataset(path, name=hub.subset, split=hub.split,
                                     streaming=hub.stream)
        if not hub.stream:
            data = data.to_iterable_dataset()
        data = data.decode(False)  # image/video features as the bytes or URL stored
        rows_iter = iter(data)
        rows = list(islice(rows_iter, limit))
        columns = list(data.column_names or (rows[0] if rows else []))
    except Exception as exc:  # the library raises its own and anything below it (network,
        # parquet, a missing split or subset); none is this project's bug
        raise ConfigError(f"--dataset-path {path} (--hf-split {hub.split}"
                          + (f", --hf-subset {hub.subset}" if hub.subset else "")
                          + f") could not be read: {_one_line(exc)}",
                          hint="check the id, split and subset on the Hub (HF_ENDPOINT, "
                               "HF_TOKEN for a gated one)", code="invalid_dataset") from None
    finally:
        # A streamed split's iterator left part-read (the rows taken, a feature lookup) and
        # collected at the interpreter's exit, after Arrow's C++ runtime had gone, killed the
        # process with "terminate called without an active exception" (SIGABRT) instead of
        # its exit status: once in this project's CI, on a dataset of an unknown schema
        # (huggingface/datasets#7566, apache/arrow#45214). Closed and collected here instead.
        close = getattr(rows_iter, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
        data = rows_iter = None
        gc.collect()
    return rows, columns


def _local_rows(path: Path, limit: int) -> tuple[list[dict], list[str]]:
    """A ShareGPT JSON file: a list of rows, or one row per line."""
    lines = read_lines(path, "dataset")
    try:
        loaded = json.loads("\n".join(lines))
        rows = loaded if isinstance(loaded, list) else [loaded]
    except (ValueError, RecursionError):
        try:
            rows = [json.loads(line) for line in lines if line.strip()]
        except (ValueError, RecursionError):
            raise ConfigError(f"--dataset-path {path} is neither JSON nor JSON lines",
                              code="invalid_dataset") from None
    rows = [r for r in rows if isinstance(r, dict)][:limit]
    return rows, list(rows[0]) if rows else []


@functools.lru_cache(maxsize=8)
def _load(name: str, path: str, hub: HubArgs, limit: int, media_dir: Path | None,
          output_len: int) -> tuple[BenchRequest, ...]:
    local = name == "sharegpt" and Path(path).is_file()
    rows, columns = _local_rows(Path(path), limit) if local else _hub_rows(path, hub, limit)
    schema = find_schema(columns, "LLaVA conversations" if name == "sharegpt" else None)
    if schema is None:
        raise unknown_schema(path, columns)
    if not rows:
        raise ConfigError(f"--dataset-path {path} has no row in --hf-split {hub.split}",
                          code="invalid_dataset")
    return tuple(to_request(row, schema, f"{path} row {n}", output_len=output_len,
                            media_dir=media_dir) for n, row in enumerate(rows))


def load_named(name: str, path: str, hub: HubArgs, *, num_prompts: int, output_len: int,
               media_dir: Path | None = None) -> list[BenchRequest]:
    """``num_prompts`` requests from the dataset (``name``: hf or sharegpt) at ``path``."""
    rows = list(_load(name, path, hub, num_prompts, media_dir,
                      hub.output_len if hub.output_len is not None else output_len))
    return (rows * (num_prompts // len(rows) + 1))[:num_prompts]
