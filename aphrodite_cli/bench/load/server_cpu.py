"""The CPU time a target on this machine spends on a phase, process by process.

Requests per second is the wall clock's figure: on a shared machine the same run can measure
2x apart an hour later, and it cannot say which process ran out of CPU. The CPU seconds each
of the target's processes spent during the phase (user + system, every thread of it, from
``/proc/PID/stat``) say what each request cost and where: per process, per request, and as
cores kept busy over the phase. A process that is busy for the whole phase (``cores`` near 1
for one process) is the one the target waits on. The kernel counts in clock ticks
(``resolution_s``, 10 ms on most systems): figures of phases shorter than a few seconds are
coarse.

The target is found by its port: the processes holding a listening TCP socket on it (the
``/proc/net/tcp`` and ``tcp6`` tables, then each process's descriptors), the supervisor above
them when it is an ``aphrodite serve`` (its API servers hold the socket; its engine is their
sibling), and every process below those (API servers, engine, workers). Linux only, and only
processes this user may read; elsewhere the phase says why it has no figures (``status``).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PROC = Path("/proc")
#: loopback names a target on this machine may have in --base-url
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def local_port(base_url: str) -> int | None:
    """The port of ``base_url`` when its host is this machine's loopback, else None."""
    parts = urlsplit(base_url)
    if (parts.hostname or "") not in LOCAL_HOSTS:
        return None
    return parts.port or (443 if parts.scheme == "https" else 80)


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode in column 10
            if len(fields) > 9 and fields[3] == "0A" and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listening_pids(port: int) -> list[int]:
    """The processes holding a socket that listens on ``port`` (those this user can see)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    pids = []
    if not wanted:
        return pids
    for entry in PROC.iterdir():
        if entry.name.isdigit() and not wanted.isdisjoint(fd_links(int(entry.name)) or ()):
            pids.append(int(entry.name))
    return sorted(pids)


def fd_links(pid: int) -> list[str] | None:
    """What each of the process's open descriptors points at (None: the process is gone or
    not this user's). A descriptor closed between the listing and its ``readlink`` is left
    out, not the process: skipping a whole busy API server in one of bench soak's samples
    once made its 12 files look like growth."""
    try:
        entries = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return None
    links = []
    for entry in entries:
        try:
            links.append(os.readlink(entry))
        except OSError:
            continue
    return links


def target_roots(port: int) -> list[int]:
    """The processes listening on ``port``, or their ``aphrodite serve`` supervisor."""
    from engine.lifetime import PROCESS_NAMES

    roots = set()
    for pid in listening_pids(port):
        root = pid
        # its parent, or its parent's parent: a supervisor starts its children from a fork
        # server (engine.server.fork_server), their parent in /proc
        ancestor = pid
        for _ in range(2):
            st = _stat(ancestor)
            ancestor = st[0] if st else 0
            if ancestor <= 1:
                break
            if _comm(ancestor) == PROCESS_NAMES["supervisor"]:
                root = ancestor
                break
        roots.add(root)
    return sorted(roots)


def _comm(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of ``pid``, None when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _name(pid: int) -> str:
    comm = _comm(pid)
    try:
        cmd = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    if not comm.startswith("python") or len(cmd) < 2:
        return comm
    # an unnamed Python process: its module or script
    args = [a.decode(errors="replace") for a in cmd[1:] if a]
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return f"python -m {args[i + 1]}"
        if arg == "-c":
            return "python -c"
        if not arg.startswith("-"):
            return f"python {Path(arg).name}"
    return comm


def tree(roots: list[int]) -> dict[int, tuple[str, float]]:
    """Every process at or below ``roots``, except this one and what it started (a target
    that started the benchmark, e.g. a test runner serving in-process): pid -> (name, CPU
    seconds so far)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents[int(entry.name)], cpu[int(entry.name)] = st
    me = os.getpid()
    parents = {pid: parent for pid, parent in parents.items() if pid != me}
    keep = set(r for r in roots if r in cpu and r != me)
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in keep and pid not in keep:
                keep.add(pid)
                grew = True
    return {pid: (_name(pid), cpu[pid]) for pid in sorted(keep)}


@dataclass
class CpuWatch:
    """Samples the target's processes (and this client) before and after a phase."""

    base_url: str
    roots: list[int] | None = None
    before: dict[int, tuple[str, float]] | None = None
    after: dict[int, tuple[str, float]] | None = None
    client_before: float = 0.0
    client_s: float = 0.0
    status: str = "ok"

    def start(self) -> None:
        self.client_before = _client_cpu()
        if not PROC.joinpath("net", "tcp").exists():
            self.status = "no /proc/net/tcp here (Linux only)"
            return
        port = local_port(self.base_url)
        if port is None:
            self.status = "the target is not on this machine's loopback"
            return
        self.roots = target_roots(port)
        if not self.roots:
            self.status = (f"no process this user can read listens on port {port} (another "
                           "user's or a container's server)")
            return
        self.before = tree(self.roots)

    def stop(self) -> None:
        self.client_s = _client_cpu() - self.client_before
        if self.before is not None and self.roots is not None:
            self.after = tree(self.roots)

    def result(self, completed: int, duration: float) -> dict[str, Any]:
        """What the target's processes spent from :meth:`start` to :meth:`stop`
        (``completed`` requests in ``duration`` seconds): totals, per request, and per
        process, busiest first."""
        out: dict[str, Any] = {"status": self.status, "client_cpu_s": round(self.client_s, 3),
                               "resolution_s": 1 / _TICKS}
        if self.before is None or self.after is None:
            return out
        after = self.after
        procs = []
        for pid, (name, cpu) in after.items():
            spent = cpu - self.before.get(pid, (name, 0.0))[1]
            procs.append({"pid": pid, "name": name, "cpu_s": round(spent, 3),
                          "cores": round(spent / duration, 3) if duration > 0 else None,
                          "cpu_ms_per_request": round(spent / completed * 1e3, 2)
                          if completed else None})
        procs.sort(key=lambda p: -p["cpu_s"])
        total = sum(p["cpu_s"] for p in procs)
        out.update({"cpu_s": round(total, 3),
                    "cores": round(total / duration, 3) if duration > 0 else None,
                    "cpu_ms_per_request": round(total / completed * 1e3, 2) if completed
                    else None,
                    "processes": procs,
                    "exited": sorted(set(self.before) - set(after))})
        return out


def _client_cpu() -> float:
    """This process's CPU seconds so far (the load generator's own cost)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
