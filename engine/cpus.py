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
