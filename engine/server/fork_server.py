"""The supervisor's fork server: how ``aphrodite serve`` starts its children.

Each child (the start-up check, the engines, the API servers) needs torch, torchvision and
transformers; a spawned child imports them again, 5-6 s of a tiny model's 18 s start-up on 2
cores, three times over. A multiprocessing fork server imports them once (:data:`PRELOAD`,
starting no thread) and forks each child from there: the tiny model's server is ready in
about 9 s. The supervisor itself still never imports them.

The fork server is the children's parent in the kernel's eyes, so their parent-death signal
(:mod:`engine.lifetime`) comes when it exits, which it does when the supervisor does: each
child lets go of its copy of the pipe that keeps it alive. Its socket sits in the server's
own folder and is removed once every child has started, so a supervisor killed outright
leaves no file of it behind.

The module reaches into four private names of :mod:`multiprocessing` (the temp folder of
this process, the fork server's alive pipe in a child, its pid and its ``_stop``), each behind a
``getattr`` or a suppressed error: on a Python without them the server still starts, as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: what the fork server imports for all the children (torch, torchvision, transformers)
PRELOAD = ("engine.server.fork_preload",)


@contextlib.contextmanager
def fork_server(folder: Path) -> Iterator[Any]:
    """A multiprocessing context whose processes start from a fork server that imported
    :data:`PRELOAD`, with its socket in ``folder`` (the server's own); the fork server is
    stopped on the way out, this process's temp folder put back."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    config = getattr(multiprocessing.current_process(), "_config", {})
    previous = config.get("tempdir")
    config["tempdir"] = str(folder)  # (where multiprocessing makes its socket)
    from multiprocessing import forkserver

    before = set(multiprocessing.active_children())  # (in a test's process: not ours)
    try:
        yield ctx
    except BaseException:  # a start-up that failed or was stopped: nothing more to fork
        _stop_children(before)
        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if pid is not None:  # (its exit would otherwise wait for its imports, up to ~8 s)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        raise
    finally:
        config["tempdir"] = previous
        _stop_children(before)
        with contextlib.suppress(Exception):  # (its socket may be gone: started_all)
            forkserver._forkserver._stop()


def _stop_children(before: set[Any], grace_s: float = 10) -> None:
    """Children of this process still running on the way out, but those of ``before`` (a
    start-up stopped halfway: the supervisor's own stop has not reached them): SIGTERM,
    ``grace_s`` seconds to drain, then SIGKILL. Until they are gone the fork server would
    not exit (each child it forks keeps its alive pipe until it lets go of it)."""
    import time

    children = [c for c in multiprocessing.active_children() if c not in before]
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.exitcode is None:
            child.kill()
            child.join(5)


def started_all(folder: Path) -> None:
    """Every child has started: remove the fork server's socket (nothing more connects), so a
    supervisor killed outright leaves only what its engines remove on their way out."""
    for path in folder.glob("listener-*"):
        with contextlib.suppress(OSError):
            path.unlink()
