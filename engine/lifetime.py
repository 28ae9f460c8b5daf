"""Child processes that do not outlive their supervisor.

``aphrodite serve`` runs an engine process and API server processes under one supervisor. If
the supervisor is killed outright (SIGKILL, the OOM killer) it cannot stop them, and they would
keep the port and the model's memory for good. On Linux the kernel can signal a child when its
parent dies (``prctl(PR_SET_PDEATHSIG)``); the children ask for SIGTERM, which drains and
stops them as a normal shutdown would.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies; False where unsupported.

    The request is tied to the parent *thread* that started this process: call it only in
    processes started from the supervisor's main thread. If the parent already died before the
    request was made, ``sig`` is raised at once.
    """
    from engine.memory import libc

    handle = libc()
    if handle is None or not hasattr(handle, "prctl"):
        return False
    if handle.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), sig)  # orphaned before the request took effect
    return True


_PR_SET_NAME = 15
#: the names the server's processes take (``ps``, ``top``, ``/proc/PID/comm``, and the
#: per-process CPU figures of ``bench serve``); Linux keeps 15 bytes
PROCESS_NAMES = {"supervisor": "aphrodite", "engine": "aphrodite-eng",
                 "api": "aphrodite-api", "decode": "aphrodite-dec"}


def name_process(role: str) -> bool:
    """Name this process after its ``role`` (a key of :data:`PROCESS_NAMES`) where ``ps``
    and ``top`` show it, instead of ``python``; False where unsupported."""
    from engine.memory import libc

    handle = libc()
    if handle is None or not hasattr(handle, "prctl"):
        return False
    return handle.prctl(_PR_SET_NAME, PROCESS_NAMES[role].encode()[:15], 0, 0, 0) == 0


def exit_sooner() -> None:
    """Leave the objects alive now out of the interpreter's last cyclic collections: with
    torch and transformers loaded those took a second of a process's exit (the tiny model's
    server stopped in 3.0 s, 1.0 s without them in its API server and its engine). Only the
    cycle collector skips them: objects still go as their references do, and ``atexit`` and
    ``weakref.finalize`` still run."""
    import gc

    gc.freeze()
