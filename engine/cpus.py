"""How many CPUs this process may use: the torch thread count an engine defaults to.

torch counts the machine's cores, so in a container or under ``taskset`` that allows 2 of 64
it starts 64 threads that fight over 2 cores. The count here is the CPU affinity of this
process, lowered by a cgroup v2 CPU quota (``cpu.max``, what ``docker run --cpus`` sets).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def quota_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """CPUs a cgroup v2 quota allows (rounded up), or None without a quota."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on, at most what its cgroup's quota allows."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = quota_cpus(cpu_max)
    return max(1, min(count, quota) if quota else count)


def use_torch_threads(count: int) -> None:
    """Run this thread's torch operations on ``count`` threads; other threads keep theirs.

    torch's thread count is a property of the calling thread (its OpenMP and MKL settings), but
    torch fills it in lazily from the count set last by any thread, at the thread's first
    parallel operation or ``get_num_threads``: asking first makes that happen now, so a count
    another thread sets later cannot replace this one.
    """
    import torch

    torch.get_num_threads()
    torch.set_num_threads(count)


def engine_share(index: int, engines: int, cpus: list[int] | None = None) -> list[int] | None:
    """The CPUs data-parallel engine ``index`` of ``engines`` is pinned to: its contiguous
    slice of the CPUs this process may run on (``cpus``; None: its affinity), the first slices
    one larger when they do not divide evenly. None when there are fewer CPUs than engines
    (engines then share them all, unpinned) or there is one engine. As vLLM's CPU backend binds
    each data-parallel rank's threads to its own cores: two engines on the same cores would
    each run their torch threads against the other's."""
    if engines <= 1:
        return None
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
    if len(cpus) < engines:
        return None
    size, extra = divmod(len(cpus), engines)
    start = index * size + min(index, extra)
    return cpus[start:start + size + (index < extra)]


def engine_threads(engines: int, cpus: int | None = None) -> int:
    """Torch threads per engine by default when ``engines`` share this process's usable CPUs
    (``cpus``; None: :func:`usable_cpus`): an even share, at least one."""
    return max(1, (usable_cpus() if cpus is None else cpus) // max(1, engines))
