"""Shared fixtures: a loopback media server with a hit counter, policies, generated media;
and the suite's own hygiene: every test's servers are stopped with their whole process group,
and the run fails if it leaves a process or a temp file behind."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from engine.config import MediaLimits, MediaPolicy
from tests import server_harness, tiers
from tests.media_server import MediaServer

GPU_ENV = "APHRODITE_FAIL_WITHOUT_GPU"

# The suite never reaches for the internet: Hugging Face libraries use only their cache, here
# and in every server and CLI the tests start (the product never sets this; the fake-Hub tests
# turn it off for their own clients, which talk to a loopback Hub).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

# Property tests: the suite (`make test`, CI) always draws the same examples, so a run is green
# or red for the code, never for the seed; exploration with fresh seeds is `make fuzz`
# (scripts/fuzz.sh), and whatever it finds is pinned here as an @example. Select with
# `--hypothesis-profile fuzz` (pytest) or HYPOTHESIS_PROFILE=fuzz.
settings.register_profile("suite", derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# Temp files: the run gets a TMPDIR of its own (inherited by every server and CLI it starts),
# so whatever is left in it at the end was left by this run. pytest's own tmp_path folders
# (pytest-of-*) live there too and are pytest's to clean.
_RUN_TMP = Path(tempfile.mkdtemp(prefix="aphrodite-tests-"))
os.environ["TMPDIR"] = str(_RUN_TMP)
tempfile.tempdir = str(_RUN_TMP)
_SHM = Path("/dev/shm")
# pytest's tmp_path folders, and torch's compile cache (created on import, meant to persist).
_NOT_OURS_TO_CLEAN = ("pytest-of-", "torchinductor_")


def pytest_unconfigure(config) -> None:
    """A run that ran no test (``--collect-only``, a ``-k`` that matched nothing) leaves no
    empty folder either (a run that did is checked and removed by leaves_nothing_behind)."""
    with contextlib.suppress(OSError):
        _RUN_TMP.rmdir()  # only when empty


def _shm_segments() -> set[str]:
    """Segments whose owner (a server process, named first) is gone: what a live server of
    another run on this machine holds is not ours, and ours all exited by the time this runs."""
    from engine.media import frame_memory

    if not _SHM.is_dir():
        return set()
    left = set()
    for path in _SHM.glob("aphrodite-*"):
        owner = frame_memory.owner_pid(path.name)
        if owner is None or not Path(f"/proc/{owner}").exists():
            left.add(path.name)
    return left


def _orphan_semaphores() -> set[str]:
    """multiprocessing's named semaphores (``sem.mp-*``) that no live process has mapped: a
    pool or queue whose process and resource tracker were both killed leaves them behind.
    (glibc maps a semaphore under a temporary name it then links, so maps are matched by
    inode, not by name.)"""
    if not _SHM.is_dir():
        return set()
    inodes = {}
    for path in _SHM.glob("sem.mp-*"):
        with contextlib.suppress(OSError):
            inodes[path.stat().st_ino] = path.name
    if not inodes:
        return set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{entry}/maps").read_text().splitlines():
                    if "/dev/shm/" in line:
                        inodes.pop(int(line.split()[4]), None)
    return set(inodes.values())


def _ours(row: server_harness.ProcessRow, groups: set[int], before: set[int]) -> bool:
    """A process this run started and that is still alive: in pytest's process group (what
    it ran, and their orphans, which keep the group) or a test server's, not there when the
    run began, not pytest itself."""
    return (row.state != "Z" and row.pid != os.getpid() and row.pid not in before
            and row.pgid in groups and not _own_resource_tracker(row))


def _own_resource_tracker(row: server_harness.ProcessRow) -> bool:
    """pytest's own multiprocessing resource tracker (started by tests that use decode
    pools in-process): it reads a pipe pytest holds open, so it ends when pytest ends."""
    if row.ppid != os.getpid():
        return False
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{row.pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind():
    """After the whole run: no process this run started is alive (servers, engines, API
    servers, decode workers, resource trackers, CLIs), and no temp file, shared-memory
    segment or named semaphore of ours is left. Processes get a grace period to finish a
    drain they began."""
    before = {row.pid for row in server_harness.process_table()}
    shm_before = _shm_segments()
    sem_before = _orphan_semaphores()
    yield
    for server in server_harness.STARTED:
        server.stop(timeout=30)
    groups = {os.getpgid(0)} | {s.pgid for s in server_harness.STARTED}
    deadline = time.monotonic() + 20  # a drained server exits within seconds; 20 s is slack
    while True:
        left = [r.pid for r in server_harness.process_table() if _ours(r, groups, before)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    shown = [server_harness.describe(pid) for pid in left]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    temp_left = sorted(p.name for p in _RUN_TMP.iterdir()
                       if not p.name.startswith(_NOT_OURS_TO_CLEAN))
    shm_left = sorted(_shm_segments() - shm_before) + sorted(_orphan_semaphores() - sem_before)
    problems = ([f"processes left running: {shown}"] if shown else []) + (
        [f"temp files left in {_RUN_TMP}: {temp_left}"] if temp_left else []) + (
        [f"shared-memory segments left: {shm_left}"] if shm_left else [])
    if not problems:
        shutil.rmtree(_RUN_TMP, ignore_errors=True)
    assert not problems, "; ".join(problems)


@pytest.fixture(autouse=True)
def stops_its_servers():
    """Servers a test started and did not stop (it failed first) are killed with their
    whole process group when the test ends, so one failure cannot leak into the next test."""
    first = len(server_harness.STARTED)
    yield
    for server in server_harness.STARTED[first:]:
        if server.proc.poll() is None or server.group_members():
            server.stop(timeout=30)


@pytest.fixture(autouse=True)
def keeps_normal_scheduling():
    """A test that leaves the test process's thread at another scheduling policy (SVT-AV1
    once left it at real-time FIFO 99: every server started by a later test inherited it, and
    its busy engine starved its own API server) fails, and the policy is put back so the
    tests after it run as they would alone."""
    if not hasattr(os, "sched_getscheduler"):
        yield
        return
    before = (os.sched_getscheduler(0), os.sched_getparam(0))
    yield
    after = (os.sched_getscheduler(0), os.sched_getparam(0))
    if after != before:
        os.sched_setscheduler(0, *before)
        pytest.fail(f"the test left this thread at scheduling policy {after[0]} priority "
                    f"{after[1].sched_priority} (it was {before[0]} / "
                    f"{before[1].sched_priority}): later servers would inherit it")


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidiactl")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tiers (its folder's and its fixtures', tests/tiers.py), so
    ``-m "not server and not vllm"`` selects by need; skip tests whose capability is
    missing, unless APHRODITE_FAIL_WITHOUT_GPU=1 says the GPU must be there (then they run
    and fail loudly)."""
    for item in items:
        try:
            marks = tiers.tiers_of(item.path.parent.name, item.fixturenames)
        except tiers.TierError as e:
            raise pytest.UsageError(f"{item.nodeid}: {e}") from None
        for tier in sorted(marks):
            item.add_marker(getattr(pytest.mark, tier))
    must_have_gpu = os.environ.get(GPU_ENV, "") not in ("", "0")
    checks = {
        "needs_gpu": (_has_nvidia_gpu, "no NVIDIA GPU"),
        "needs_ffmpeg_cli": (lambda: shutil.which("ffmpeg") is not None, "no ffmpeg CLI"),
        "needs_browser": (lambda: shutil.which("chromium") is not None, "no chromium"),
        "needs_gstreamer": (lambda: importlib.util.find_spec("gi") is not None,
                            "no GStreamer Python bindings (gi)"),
    }
    for item in items:
        for marker, (present, why) in checks.items():
            if item.get_closest_marker(marker) and not present():
                if marker == "needs_gpu" and must_have_gpu:
                    continue
                item.add_marker(pytest.mark.skip(reason=why))
    _keep_shard(config, items)


#: ``K/2``: run only shard K of the suite (scripts/test_suite.sh, what ``make test`` runs,
#: runs the two at once); taken out of the environment, so no server or CLI a test starts
#: sees it (the product warns of APHRODITE_* names it does not know, hence not one of those)
SHARD_ENV = "SUITE_SHARD"
_SHARD = os.environ.pop(SHARD_ENV, "")
#: the first shard's folders (the second: the others); about even in time (2026-12-07)
FIRST_SHARD = frozenset({"server", "media"})


def _keep_shard(config, items) -> None:
    """Under ``SUITE_SHARD=K/2``, deselect the other shard's tests. A test goes by
    its folder, a served test by its ask: all of an ask's tests go to the shard holding most
    of them, so no server is started by both shards."""
    spec = _SHARD
    if not spec:
        return
    if spec not in ("1/2", "2/2"):
        raise pytest.UsageError(f"{SHARD_ENV}={spec!r}: it takes 1/2 or 2/2")
    from tests import served

    def folder_shard(item) -> int:
        return 1 if item.path.parent.name in FIRST_SHARD else 2

    votes: dict = {}
    for item in items:
        ask = served.ask_of(item)
        if ask is not None:
            votes.setdefault(ask, collections.Counter())[folder_shard(item)] += 1
    owner = {ask: 1 if count[1] >= count[2] else 2 for ask, count in votes.items()}
    mine = int(spec[0])
    keep, drop = [], []
    for item in items:
        ask = served.ask_of(item)
        shard = owner[ask] if ask is not None else folder_shard(item)
        (keep if shard == mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_generate_tests(metafunc):
    """``served`` (tests/served.py): a session-scoped parameter, one value per engine the
    test runs on (``@pytest.mark.engines(...)``, "ours" unless marked) with the flags of its
    ``@pytest.mark.serve(...)``. ``engine`` without ``served``: a module-scoped parameter,
    the same engines."""
    definition = metafunc.definition
    if "served" in metafunc.fixturenames:
        from tests import served

        metafunc.parametrize("served", served.params(definition.get_closest_marker("serve"),
                                                     definition.get_closest_marker("engines")),
                             indirect=True, scope="session")
    elif "engine" in metafunc.fixturenames:
        from tests.engines import engine_params

        marker = definition.get_closest_marker("engines")
        params = engine_params()
        metafunc.parametrize("engine", [params[e] for e in (marker.args if marker else
                                                              ("ours",))], scope="module")


@pytest.fixture(scope="session")
def served(request):
    """The `aphrodite serve` the test asks for (tests/served.py): started by the first test
    of its ask, shared by every test that asks the same, stopped after the last of them
    (pytest runs a session-scoped parameter's tests together)."""
    from tests import served as pool

    yield pool.get(request.param)
    pool.release(request.param)


@pytest.fixture
def engine(served):
    """The engine of the test's ``served`` server ("ours" or "vllm")."""
    return served.key.engine


def pytest_collection_finish(session):
    from tests import served

    served.plan(session.items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A served server stops after the last test that asks for it (tests/served.py)."""
    from tests import served

    served.done(item)


def pytest_terminal_summary(terminalreporter):
    from tests import served

    line = served.summary(server_harness.STARTED)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture
def media_server():
    """A real HTTP media server on 127.0.0.1 with a hit counter (tests/media_server.py)."""
    host = MediaServer()
    yield host
    host.stop()


@pytest.fixture
def loopback_policy() -> MediaPolicy:
    """A policy that allows the loopback media server by listing its host."""
    return MediaPolicy.create(allowed_domains=["127.0.0.1"])


@pytest.fixture
def limits() -> MediaLimits:
    return MediaLimits.from_env()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A loopback fake Hugging Face Hub the already imported huggingface_hub talks to
    (tests/fake_hub.py), with its own cache under ``tmp_path``."""
    from tests.fake_hub import FakeHub

    with FakeHub() as fake:
        fake.patch_client(monkeypatch, tmp_path / "hf")
        yield fake


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> str:
    """The cached tiny Qwen2.5-VL's folder (its tokenizer: the benchmarks' token tests)."""
    from engine.models.loader import resolve_model_path

    return str(resolve_model_path("tiny:qwen2_5_vl"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def recording_mock():
    """The mock in a thread of this process (its own loop), recording what arrives, so a
    `bench serve` process can be pointed at it."""
    import asyncio
    import threading

    from aiohttp import web

    from aphrodite_cli.bench.load.mock_server import create_app

    seen: list[dict] = []
    port = server_harness.free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(5, 20, None, seen=seen))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port, seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.run_until_complete(runner.cleanup())
    loop.close()
