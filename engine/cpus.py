"""How many CPUs this process may use: the torch thread count an engine defaults to.

torch counts the machine's cores, so in a container or under ``taskset`` that allows 2 of 64
it starts 64 threads that fight over 2 cores. The count here is the CPU affinity of this
process, lowered by a cgroup v2 CPU quota (``cpu.max``, what ``docker run --cpus`` sets).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

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


def in_own_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run on a new thread that ends with it (its exception raised
    here): the OpenMP worker threads its torch operations start end with it too.

    libgomp keeps a pool of workers for each thread that ran a parallel region, for the rest
    of that thread's life; while it manages more threads than there are CPUs, the workers of
    every pool stop spinning between regions and sleep on a futex instead, and each of a
    decode step's many small products then waits for its workers to wake. Loading a model on
    the thread that later waits for answers, then stepping on the engine's own thread, made a
    2-thread decode step of the 150 M-parameter model 1.2-1.3x slower on 2 CPUs (44.3 against
    36.1 ms, 8 rows). Model loads go through here, and the threads that work beside the
    engine's run one torch thread (:func:`one_torch_thread_pool`), so that the engine's
    threads hold the only pools."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # (raised again on the calling thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"aphrodite-{getattr(fn, '__name__', 'call')}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box.pop("error")
    return box["value"]


def one_torch_thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run one torch thread each: work beside an engine's steps
    (media preparation) that starts no OpenMP workers of its own (see :func:`in_own_thread`)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=use_torch_threads,
                              initargs=(1,))


SYS_CPU = Path("/sys/devices/system/cpu")


def _cpu_list(text: str) -> list[int]:
    """``0-3,8`` as ``[0, 1, 2, 3, 8]`` (the kernel's CPU list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def physical_cores(cpus: list[int], sys_cpu: Path = SYS_CPU) -> list[list[int]]:
    """``cpus`` grouped by physical core (a core's SMT siblings together, from the kernel's
    ``thread_siblings_list``; a CPU whose topology cannot be read is a core of its own), in
    the order of their lowest CPU."""
    groups: dict[int, list[int]] = {}
    for cpu in cpus:
        try:
            key = min(_cpu_list((sys_cpu / f"cpu{cpu}" / "topology" /
                                 "thread_siblings_list").read_text()))
        except (OSError, ValueError):
            key = cpu
        groups.setdefault(key, []).append(cpu)
    return [groups[key] for key in sorted(groups)]


def engine_share(index: int, engines: int, cpus: list[int] | None = None,
                 sys_cpu: Path = SYS_CPU) -> list[int] | None:
    """The CPUs data-parallel engine ``index`` of ``engines`` is pinned to: its contiguous
    slice of the physical cores this process may run on (``cpus``; None: its affinity), SMT
    siblings kept together (Linux numbers a core's second thread after every core's first,
    so a slice of CPU numbers would give two engines the two threads of the same cores), the
    first slices one core larger when they do not divide evenly. With fewer cores than
    engines, slices of the CPUs themselves; None when there are fewer CPUs than engines
    (engines then share them all, unpinned) or there is one engine. As vLLM's CPU backend
    binds each data-parallel rank's threads to its own cores: two engines on the same cores
    would each run their torch threads against the other's."""
    if engines <= 1:
        return None
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
    if len(cpus) < engines:
        return None
    cores = physical_cores(cpus, sys_cpu)
    units = cores if len(cores) >= engines else [[cpu] for cpu in cpus]
    size, extra = divmod(len(units), engines)
    start = index * size + min(index, extra)
    return sorted(cpu for unit in units[start:start + size + (index < extra)] for cpu in unit)


def engine_threads(engines: int, cpus: int | None = None) -> int:
    """Torch threads per engine by default when ``engines`` share this process's usable CPUs
    (``cpus``; None: :func:`usable_cpus`): an even share, at least one."""
    return max(1, (usable_cpus() if cpus is None else cpus) // max(1, engines))


#: below this many parameters an engine runs one torch thread by default (see
#: :func:`auto_parallel`)
ONE_THREAD_PARAMETERS = 10_000_000


def auto_parallel(parameters: int | None, cpus: int) -> tuple[int, int | None]:
    """``serve``'s default engines and torch threads per engine on a CPU device, from the
    model's ``parameters`` (None: unknown) and the ``cpus`` the server may use: ``(engines,
    threads)``, threads None for every CPU an engine has (``--num-threads``' own default).

    - below :data:`ONE_THREAD_PARAMETERS`: one engine on one thread (a decode step of such
      a model is mostly Python between small products: a second thread costs more than it
      saves);
    - larger (or unknown): one engine on every CPU. On 2 cores the 43 M- and 150 M-parameter
      models once served more with an engine per core (one thread each); since the decode
      kernels' products split over the threads and the engine's threads hold the only
      OpenMP pools (:func:`in_own_thread`), one engine on both cores serves as much cold and
      1.1-1.7x warm, with one copy of the weights and of the caches.

    docs/performance.md's "Engines and threads by default" has the measurements."""
    if parameters is not None and parameters < ONE_THREAD_PARAMETERS:
        return 1, 1
    return 1, None
