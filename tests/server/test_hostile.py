"""The hostile catalogue end to end: every entry once against a real server (real HTTP, the
attacker's loopback media host), each refused with its status and by its rule, nothing
answered with a 5xx, and the server healthy afterwards with no segment or temp file left."""

from __future__ import annotations

import json
import urllib.error
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


def send(server, case):
    return post(f"{server.base}/v1", case.body, case.content_type, case.path)


#: issue 25's kinds: decoders failing their own way or working too hard, text that cannot fit
NEW_KINDS = {
    "dds-not-implemented": (422, "media_decode_failed"),
    "foreign-exception-video": (422, "media_decode_failed"),
    "resolution-switch": (422, "video_frame_size_changed"),
    "many-scan-jpeg": (413, "image_decode_too_costly"),
    "too-many-messages": (400, "too_many_messages"),
    "huge-prompt": (400, "prompt_too_long"),
    "huge-prompt-completions": (400, "prompt_too_long"),
}


def test_the_catalogue_holds_the_decoder_and_text_kinds_with_their_rules():
    """Built without a server: each with its status and rule, each body under the soak's
    2 MB cap (so the rule it meets is its own, not the body cap's 413)."""
    catalogue = {c.name: c for c in hostile_catalogue("tiny-qwen2_5_vl", "http://127.0.0.1:1")}
    assert {name: (catalogue[name].status, catalogue[name].code) for name in NEW_KINDS} \
        == NEW_KINDS
    assert all(len(catalogue[name].body) < 2 << 20 for name in NEW_KINDS)
    assert catalogue["huge-prompt-completions"].path == "/completions"
    assert len(catalogue["many-scan-jpeg"].body) < 100_000


def test_every_hostile_request_is_refused_by_its_rule(attacked):
    server, host = attacked
    catalogue = hostile_catalogue("tiny-qwen2_5_vl", host.base)
    assert len(catalogue) >= 35 and len({c.name for c in catalogue}) == len(catalogue)
    outcomes = {c.name: send(server, c) for c in catalogue}
    wrong = {c.name: (outcomes[c.name], c.status, c.code) for c in catalogue
             if outcomes[c.name][0] != c.status
             or (c.code is not None and outcomes[c.name][1] != c.code)}
    assert wrong == {}
    assert all(0 < status < 500 for status, _ in outcomes.values())
    assert {name: outcomes[name] for name in NEW_KINDS} == NEW_KINDS


def test_a_decoder_failure_names_its_item_and_costs_no_worker(attacked):
    """The DDS Pillow does not implement: 422 naming media item 1; no decode worker was
    replaced for it (nor for any other kind: see the all-at-once test)."""
    server, host = attacked
    case = next(c for c in hostile_catalogue("tiny-qwen2_5_vl", host.base)
                if c.name == "dds-not-implemented")
    req = urllib.request.Request(f"{server.base}/v1/chat/completions", data=case.body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 422 and error["code"] == "media_decode_failed"
    assert error["message"].startswith("media item 1 (image)"), error
    metrics = urllib.request.urlopen(f"{server.base}/metrics", timeout=30).read().decode()
    assert "aphrodite_decode_worker_restarts_total 0.0" in metrics


def test_hostile_traffic_all_at_once_leaves_the_server_healthy(attacked):
    server, host = attacked
    catalogue = hostile_catalogue("tiny-qwen2_5_vl", host.base) * 2
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda c: send(server, c), catalogue))
    assert [s for s, _ in outcomes] == [c.status for c in catalogue]
    health = json.loads(urllib.request.urlopen(f"{server.base}/health", timeout=30).read())
    assert health == {"status": "ok"}
    metrics = urllib.request.urlopen(f"{server.base}/metrics", timeout=30).read().decode()
    assert "aphrodite_media_bytes_in_flight 0.0" in metrics
    assert "aphrodite_decode_worker_restarts_total 0.0" in metrics
    pid = server.pid_of("API server")  # (from its --process-file)
    held = [p for p in frame_memory.SHM_DIR.glob(f"{frame_memory.PREFIX}{pid}-*")
            if not p.name.endswith(frame_memory.FREE)]  # free ones wait for their worker
    assert not held
