"""One fixture for every served test: ``served``, the `aphrodite serve` the test asks for.

A test (or its module, in ``pytestmark``, or its class) says what server it needs with
``@pytest.mark.serve(*flags, model=..., env={...}, fresh=...)`` and takes ``served``; the
engines it runs on come from ``@pytest.mark.engines(...)`` (tests/engines.py: "ours" unless
marked). Each distinct ask, a :class:`Serve` (engine, model, flags, environment, ``fresh``),
is one value of ``served``, a session-scoped parameter (``tests/conftest.py``
parametrizes it), so:

- the tests that ask the same, in any module, share one server, started by the first of
  them and stopped (its exit status checked) when the last of them ends;
- pytest runs them together (it groups the tests of a session-scoped parameter's value), so
  one served server is alive at a time, and none while the tests that start their own run;
- the vLLM variant of an ask carries the ``vllm`` marker and a timeout with room for its
  engine's start-up (its first test starts it).

A test that needs a server nobody else has used (it counts from zero on ``/metrics``, signals
or kills the server, reads its process ids) names it with ``fresh="why"``: equal flags with
another ``fresh`` (or none) are another server. ``{scratch}`` in a flag is a folder of the
server's own (``served.scratch``), made before it starts and removed after it stops;
``prepare=write`` (a module-level function) writes what the server reads at start-up into
it: ``write(scratch)``.

A server another process must run beside (vLLM's own server beside ``serve --engine vllm``,
tests/vllm) is that ask's companion: :data:`BESIDE` names the tests that use it and how to
start it; when one of them is in the session, it starts with the ask's server, their start-ups
overlapping (each takes about one of 2 cores), and the test takes it with :func:`take`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engines import ENGINES, engine_params, serve
from tests.server_harness import ServerProcess

SCRATCH = "{scratch}"


@dataclasses.dataclass(frozen=True)
class Serve:
    """One ask: equal asks share a server."""

    engine: str = "ours"
    flags: tuple[str, ...] = ()
    #: the model argument (ours: "tiny:qwen2_5_vl" by default; vLLM's: always its tiny
    #: Qwen2.5-VL, tests/engines.py)
    model: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    fresh: str = ""
    #: writes into the scratch folder before the server starts
    prepare: Callable[[Path], None] | None = None

    @property
    def id(self) -> str:
        return self.engine if not self.fresh else f"{self.engine}-{self.fresh}"


def asks(marker: pytest.Mark | None, engines: pytest.Mark | None) -> list[Serve]:
    """What a test's ``serve`` and ``engines`` markers ask for, one :class:`Serve` per engine."""
    flags, kwargs = (marker.args, dict(marker.kwargs)) if marker else ((), {})
    unknown = set(kwargs) - {"model", "env", "fresh", "prepare"}
    if unknown:
        raise TypeError("@pytest.mark.serve takes model, env, fresh and prepare, not "
                        f"{sorted(unknown)}")
    names = engines.args if engines else ("ours",)
    if set(names) - set(ENGINES):
        raise ValueError(f"@pytest.mark.engines names {names}; the engines are {ENGINES}")
    env = tuple(sorted((kwargs.get("env") or {}).items()))
    return [Serve(name, normalised(flags), kwargs.get("model"), env, kwargs.get("fresh", ""),
                  kwargs.get("prepare")) for name in names]


def normalised(flags: tuple) -> tuple[str, ...]:
    """``flags`` with each option and its values kept together and the options sorted: the
    same flags in another order are the same ask."""
    groups: list[list[str]] = []
    for flag in map(str, flags):
        if flag.startswith("--") or not groups:
            groups.append([flag])
        else:
            groups[-1].append(flag)
    return tuple(f for group in sorted(groups) for f in group)


def params(marker: pytest.Mark | None, engines: pytest.Mark | None) -> list:
    """``served``'s values for a test, as pytest params: vLLM's marked as its engine's are."""
    out = []
    for ask in asks(marker, engines):
        base = engine_params()[ask.engine]
        out.append(pytest.param(ask, id=ask.id, marks=base.marks))
    return out


#: start-ups by this session's ``served``, in order (the terminal summary reports them)
STARTS: list[Serve] = []
#: the servers running now, by ask, with their scratch folders
RUNNING: dict[Serve, tuple[ServerProcess, Path | None]] = {}
#: each ask's last test (its node id) in the session's order: its server stops after it
LAST: dict[Serve, str] = {}
#: by ask, what starts beside its server: the tests that use it (a node id prefix) and a
#: function of no argument starting it (an object with ``stop()``), without waiting for it
BESIDE: dict[Serve, tuple[str, Callable[[], Any]]] = {}
#: the asks whose companion this session's tests use
WANTED: set[Serve] = set()
#: the companions running now, by ask
COMPANIONS: dict[Serve, Any] = {}


def plan(items: list[pytest.Item]) -> None:
    """Note each ask's last test, in the order the session runs them, and which asks'
    companions the session's tests use."""
    LAST.clear()
    LAST.update(last_tests(items))
    WANTED.clear()
    for item in items:
        ask = ask_of(item)
        if ask in BESIDE and item.nodeid.startswith(BESIDE[ask][0]):
            WANTED.add(ask)


def take(ask: Serve) -> Any:
    """The companion started beside ``ask``'s server (the caller stops it), or None."""
    return COMPANIONS.pop(ask, None)


def last_tests(items: list[pytest.Item]) -> dict[Serve, str]:
    """Each ask's last test (node id) among ``items``, in their order."""
    last = {}
    for item in items:
        ask = ask_of(item)
        if ask is not None:
            last[ask] = item.nodeid
    return last


def ask_of(item: pytest.Item) -> Serve | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("served") if callspec else None


def get(ask: Serve) -> ServerProcess:
    """``ask``'s server: the running one, or a new one."""
    if ask not in RUNNING:
        RUNNING[ask] = start(ask)
    return RUNNING[ask][0]


def release(ask: Serve) -> None:
    """Stop ``ask``'s server if it runs (its exit status checked), and a companion nobody
    took."""
    companion = COMPANIONS.pop(ask, None)
    try:
        if ask in RUNNING:
            stop(*RUNNING.pop(ask))
    finally:
        if companion is not None:
            companion.stop()


def done(item: pytest.Item) -> None:
    """After a test: stop its server if no later test asks for it."""
    ask = ask_of(item)
    if ask is not None and LAST.get(ask) == item.nodeid:
        release(ask)


def start(ask: Serve) -> tuple[ServerProcess, Path | None]:
    """The server ``ask`` describes, ready; its scratch folder if a flag names one."""
    scratch = None
    flags = ask.flags
    if any(SCRATCH in f for f in flags) or ask.prepare:
        scratch = Path(tempfile.mkdtemp(prefix="served-"))
        flags = tuple(f.replace(SCRATCH, str(scratch)) for f in flags)
    model = (ask.model,) if ask.model and ask.engine == "ours" else ()
    try:
        if ask.prepare:
            ask.prepare(scratch)
        if ask in WANTED:
            COMPANIONS[ask] = BESIDE[ask][1]()
        server = serve(ask.engine, *model, *flags, env=dict(ask.env) or None)
    except BaseException:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        companion = COMPANIONS.pop(ask, None)
        if companion is not None:
            companion.stop()
        raise
    STARTS.append(ask)
    server.key = ask
    server.scratch = scratch
    return server, scratch


def stop(server: ServerProcess, scratch: Path | None) -> None:
    try:
        assert server.stop(timeout=60) == 0, server.output[-3000:]
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def summary(started: list[ServerProcess]) -> str | None:
    """One line for the run's end: the servers ``served`` started (vLLM's counted), and the
    `aphrodite serve` processes the run started in all (``started``: served's and the tests'
    own)."""
    if not started:
        return None
    vllm = sum(ask.engine == "vllm" for ask in STARTS)
    on_vllm = sum("vllm" in server.proc.args for server in started)
    return (f"servers: {len(started)} `aphrodite serve` start-ups ({on_vllm} on vLLM's "
            f"engine), {len(STARTS)} of them by the served fixture ({vllm} on vLLM's)")
