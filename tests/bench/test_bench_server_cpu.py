"""bench serve's per-process CPU figures of a target on this machine (server_cpu), against
real processes: a server laid out as `aphrodite serve` lays itself out (a supervisor named
as the server names it, a listening child, and a sibling that does the work), found by its
port through /proc, with the work counted to the sibling that did it."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from aphrodite_cli.bench.load import server_cpu
from aphrodite_cli.bench.load.server_cpu import CpuWatch
from aphrodite_cli.bench.results.serve_text import describe

pytestmark = pytest.mark.skipif(not server_cpu.PROC.joinpath("net", "tcp").exists(),
                                reason="reads /proc (Linux)")

#: a supervisor named as aphrodite's, with a listener child and a worker child that burns
#: CPU for as long as the file named by argv[2] exists
SUPERVISOR = textwrap.dedent("""
    import os, socket, subprocess, sys, time
    from engine.lifetime import name_process
    name_process("supervisor")
    port, flag = sys.argv[1], sys.argv[2]
    listener = subprocess.Popen([sys.executable, "-c", '''
    import socket, sys, time
    s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
    print("listening", flush=True); time.sleep(600)
    ''', port], stdout=subprocess.PIPE, text=True)
    listener.stdout.readline()
    worker = subprocess.Popen([sys.executable, "-c", '''
    import os, sys, time
    while True:
        if os.path.exists(sys.argv[1]):
            end = time.process_time() + 0.05
            while time.process_time() < end: pass
        else:
            time.sleep(0.01)
    ''', flag])
    print(listener.pid, worker.pid, flush=True)
    time.sleep(600)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_work_of_a_supervised_target_is_counted_to_the_process_that_did_it(tmp_path):
    port, flag = _free_port(), tmp_path / "burn"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(port), str(flag)],
                           stdout=subprocess.PIPE, text=True)
    try:
        listener, worker = map(int, sup.stdout.readline().split())
        assert server_cpu.listening_pids(port) == [listener]
        # the listener's parent is the supervisor: it is the root, so its other child counts
        assert server_cpu.target_roots(port) == [sup.pid]
        watch = CpuWatch(f"http://127.0.0.1:{port}/v1")
        watch.start()
        assert watch.status == "ok" and set(watch.before) >= {sup.pid, listener, worker}
        flag.touch()
        busy_until = time.monotonic() + 30
        while time.monotonic() < busy_until and \
                server_cpu._stat(worker)[1] - watch.before[worker][1] < 0.5:
            time.sleep(0.05)
        flag.unlink()
        watch.stop()
        result = watch.result(completed=4, duration=2.0)
        by_pid = {p["pid"]: p for p in result["processes"]}
        assert by_pid[worker]["cpu_s"] >= 0.5
        assert result["processes"][0]["pid"] == worker  # busiest first
        assert by_pid[sup.pid]["name"] == "aphrodite" and by_pid[worker]["name"] == "python -c"
        assert result["cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in result["processes"]),
                                                abs=0.01)
        assert result["cpu_ms_per_request"] == pytest.approx(result["cpu_s"] / 4 * 1e3,
                                                             abs=0.1)
        assert result["cores"] == pytest.approx(result["cpu_s"] / 2.0, abs=0.01)
        assert "server CPU:" in describe(result) and "python -c" in \
            describe(result)
    finally:
        for pid in server_cpu.tree([sup.pid]):  # the supervisor's children, before it goes
            if pid != sup.pid:
                subprocess.run(["kill", "-9", str(pid)], check=False)
        sup.kill()
        sup.wait()


def test_targets_it_cannot_read_say_why_and_have_no_figures():
    remote = CpuWatch("http://example.com:8000/v1")
    remote.start()
    remote.stop()
    out = remote.result(completed=3, duration=1.0)
    assert out["status"] == "the target is not on this machine's loopback"
    assert "cpu_s" not in out and "not measured" in describe(out)
    nobody = CpuWatch(f"http://localhost:{_free_port()}")
    nobody.start()
    nobody.stop()
    assert nobody.result(3, 1.0)["status"].startswith("no process this user can read")


def test_the_benchmark_itself_is_never_part_of_its_target():
    """A target served from the benchmark's own process (a test runner, a notebook): the
    benchmark's process is left out of its tree."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert server_cpu.target_roots(port) == [server_cpu.os.getpid()]
        assert server_cpu.tree(server_cpu.target_roots(port)) == {}


def test_local_port_reads_loopback_urls_only():
    assert server_cpu.local_port("http://127.0.0.1:2242/v1") == 2242
    assert server_cpu.local_port("http://localhost") == 80
    assert server_cpu.local_port("https://[::1]/v1") == 443
    assert server_cpu.local_port("http://10.0.0.5:2242") is None
