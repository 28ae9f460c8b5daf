"""How many of this project's engines ``serve`` starts and on how many torch threads each,
where the flags leave it open (``--data-parallel-size auto``, no ``--num-threads``): the rule
is :func:`engine.cpus.auto_parallel`, from the checkpoint's parameter count
(:func:`engine.models.checkpoint.parameters`, read before any engine loads it) and the CPUs
the server may use."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig, ParallelConfig
from engine.cpus import auto_parallel, engine_threads, usable_cpus
from engine.models.checkpoint import parameters


def engines_and_threads(parallel: ParallelConfig, engine: EngineConfig, model: Path,
                        cpus: int | None = None) -> tuple[int, EngineConfig]:
    """The engine count and the engine settings each starts with: a count given stays, with
    an even share of the CPUs as threads unless ``--num-threads`` is given; "auto" on a CPU
    device follows :func:`engine.cpus.auto_parallel` (threads too, unless given), elsewhere
    one engine."""
    cpus = usable_cpus() if cpus is None else cpus
    count = parallel.data_parallel_count
    threads: int | None = None
    if count is None:
        count, threads = auto_parallel(parameters(model), cpus) \
            if str(engine.device) == "cpu" else (1, None)
    elif count > 1:
        threads = engine_threads(count, cpus)
    if engine.num_threads is None and threads is not None:
        engine = replace(engine, num_threads=threads)
    return count, engine
