"""The hostile catalogue end to end: every entry once against a real server (real HTTP, the
attacker's loopback media host), each refused with its status and by its rule, nothing
answered with a 5xx, and the server healthy afterwards with no segment or temp file left."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from aphrodite_cli.bench.load.hostile import SERVER_ARGS, SERVER_ENV, HostileHost, hostile_catalogue
from aphrodite_cli.bench.load.soak import post
from engine.media import frame_memory
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def attacked():
    host = HostileHost()
    server = ServerProcess("--allowed-media-domains", "127.0.0.1", *SERVER_ARGS,
                           env=SERVER_ENV).wait_ready()
    yield server, host
    assert server.stop() == 0
    host.close()


def test_every_hostile_request_is_refused_by_its_rule(attacked):
    server, host = attacked
    catalogue = hostile_catalogue("tiny-qwen2_5_vl", host.base)
    assert len(catalogue) >= 35 and len({c.name for c in catalogue}) == len(catalogue)
    outcomes = {c.name: post(f"{server.base}/v1", c.body, c.content_type) for c in catalogue}
    wrong = {c.name: (outcomes[c.name], c.status, c.code) for c in catalogue
             if outcomes[c.name][0] != c.status
             or (c.code is not None and outcomes[c.name][1] != c.code)}
    assert wrong == {}
    assert all(0 < status < 500 for status, _ in outcomes.values())


def test_hostile_traffic_all_at_once_leaves_the_server_healthy(attacked):
    server, host = attacked
    catalogue = hostile_catalogue("tiny-qwen2_5_vl", host.base) * 2
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda c: post(f"{server.base}/v1", c.body, c.content_type),
                                 catalogue))
    assert [s for s, _ in outcomes] == [c.status for c in catalogue]
    health = json.loads(urllib.request.urlopen(f"{server.base}/health", timeout=30).read())
    assert health == {"status": "ok"}
    metrics = urllib.request.urlopen(f"{server.base}/metrics", timeout=30).read().decode()
    assert "aphrodite_media_bytes_in_flight 0.0" in metrics
    assert "aphrodite_decode_worker_restarts_total 0.0" in metrics
    pid = server.pid_of("API server")  # "API server pids N"
    held = [p for p in frame_memory.SHM_DIR.glob(f"{frame_memory.PREFIX}{pid}-*")
            if not p.name.endswith(frame_memory.FREE)]  # free ones wait for their worker
    assert not held
