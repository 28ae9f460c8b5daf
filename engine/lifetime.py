"""Child processes that do not outlive their supervisor.

``aphrodite serve`` runs an engine process and API server processes under one supervisor. If
the supervisor is killed outright (SIGKILL, the OOM killer) it cannot stop them, and they would
keep the port and the model's memory for good. On Linux the kernel can signal a child when its
parent dies (``prctl(PR_SET_PDEATHSIG)``); the children ask for SIGTERM, which drains and
stops them as a normal shutdown would. The supervisor starts them from a multiprocessing fork
server (:mod:`engine.server.fork_server`), their parent in the kernel's eyes:
each child lets go of its copy of the pipe that keeps the fork server alive, so the fork
server exits with the supervisor and the kernel signals the children then.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies; False where unsupported.

    The request is tied to the parent *thread* that started this process: call it only in
    processes started from the supervisor's main thread (or its fork server). If the
    supervisor already died before the request was made, ``sig`` is raised at once.
    """
    from engine.memory import libc

    handle = libc()
    if handle is None or not hasattr(handle, "prctl"):
        return False
    if handle.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # a fork server's child (or orphaned)
        _leave_fork_server()
        if not _exists(parent.pid):
            os.kill(os.getpid(), sig)  # orphaned before the request took effect
    return True


def _leave_fork_server() -> None:
    """In a child of a multiprocessing fork server: close this process's copy of the pipe whose
    other end tells the fork server that its client (the supervisor) is alive, so that the
    fork server exits when the supervisor dies, not when its last child does; its exit is
    then the parent death the kernel signals this process for."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        with contextlib.suppress(OSError):
            os.close(fd)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
