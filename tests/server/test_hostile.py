"""The hostile catalogue end to end: every entry once against a real server (real HTTP, the
attacker's loopback media host), each refused with its status and by its rule, nothing
answered with a 5xx, and the server healthy afterwards with no segment or temp file left."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from aphrodite_cli.bench.load.hostile import SERVER_ARGS, SERVER_ENV, HostileHost, hostile_catalogue
from aphrodite_cli.bench.load.soak import post
from engine.media import frame_memory

pytestmark = [pytest.mark.timeout(400), pytest.mark.serve(
    "--allowed-media-domains", "127.0.0.1", *SERVER_ARGS, env=SERVER_ENV)]


@pytest.fixture(scope="module")
def host():
    host = HostileHost()
    yield host
    host.close()


@pytest.fixture
def attacked(served, host):
    """The module's server (its ``serve`` mark, tests/served.py) and the hostile host."""
    return served, host


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


#: issue 47's kinds: the request features past plain chat, served or refused by their rule,
#: and the schema bombs, each refused at once naming its field or served in bounded time
BAD = "invalid_structured_output"
FEATURE_KINDS = {
    "json-schema": (200, None), "structured-outputs-json": (200, None),
    "guided-json": (200, None), "guided-regex": (200, None), "guided-choice": (200, None),
    "tool-choice-named": (200, None), "tool-choice-required": (200, None),
    "tool-choice-auto": (400, "unsupported_parameter"), "cache-salt": (200, None),
    "cache-salt-not-a-string": (400, None),
    "uuid-with-media": (200, None), "uuid-known": (200, None),
    "uuid-unknown": (400, "unknown_media_uuid"), "uuid-other-tenant": (400, "unknown_media_uuid"),
    "regex-backtracking": (200, None), "pattern-backtracking": (200, None),
    "regex-huge-repetition": (200, None), "schema-recursive-ref": (200, None),
    "schema-huge-min-items": (200, None), "schema-huge-required": (200, None),
    "schema-deep": (400, BAD), "schema-deep-in-body": (400, "invalid_json"),
    "schema-huge-enum": (400, BAD), "schema-huge-properties": (400, BAD),
    "schema-huge-required-properties": (400, BAD), "pattern-huge-repetition": (400, BAD),
    "pattern-long-class": (400, BAD), "pattern-nested-ranges": (400, BAD),
    "schema-ref-cycle": (400, BAD),
    "schema-ref-self": (400, BAD), "schema-ref-missing": (400, BAD),
    "schema-huge-max-length": (400, BAD), "schema-huge-min-length": (400, BAD),
    "choice-too-many": (400, BAD), "tool-parameters-bomb": (400, BAD),
    "regex-nested-ranges": (400, BAD),
    "tool-arguments-deep": (400, "invalid_tool_message"),
    "tool-arguments-deep-template": (400, "chat_template_error"),
}


def test_the_catalogue_holds_the_request_features_and_schema_bombs():
    """Built without a server: each with its status and rule, each body under the soak's
    2 MB cap; the case that gives the uuid its media is sent first (``first``) and comes
    before the one naming it."""
    cases = hostile_catalogue("tiny-qwen2_5_vl", "http://127.0.0.1:1")
    catalogue = {c.name: c for c in cases}
    assert {name: (catalogue[name].status, catalogue[name].code) for name in FEATURE_KINDS} \
        == FEATURE_KINDS
    assert all(len(catalogue[name].body) < 2 << 20 for name in FEATURE_KINDS)
    assert [c.name for c in cases if c.first] == ["uuid-with-media"]
    names = [c.name for c in cases]
    assert names.index("uuid-with-media") < names.index("uuid-known")


def test_schema_bombs_are_answered_in_bounded_time_and_the_server_keeps_serving(attacked):
    """Each bomb alone, timed: refused naming its field (or served) within 30 s, never a
    5xx; a plain request is served after each. (The nested ranges, ``(.{0,100}){0,100}``
    with 1000 tokens, ran 57 s for 300 tokens before its grammar time was bounded, every
    batch-mate's step waiting on its mask.)"""
    server, host = attacked
    control = next(c for c in hostile_catalogue("tiny-qwen2_5_vl", host.base)
                   if c.name == "one-by-one-image")
    for case in hostile_catalogue("tiny-qwen2_5_vl", host.base):
        if case.name not in FEATURE_KINDS or case.name.startswith(("uuid", "cache-salt")):
            continue
        start = time.monotonic()
        status, code = send(server, case)
        took = time.monotonic() - start
        assert (status, code if case.code else None) == FEATURE_KINDS[case.name], case.name
        assert took < 30, (case.name, took)
        assert send(server, control) == (200, None), case.name


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
    assert {name: (outcomes[name][0], outcomes[name][1] if FEATURE_KINDS[name][1] else None)
            for name in FEATURE_KINDS} == FEATURE_KINDS


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
    catalogue = hostile_catalogue("tiny-qwen2_5_vl", host.base)
    assert [send(server, c)[0] for c in catalogue if c.first] == [200]  # the uuid's media
    catalogue *= 2
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
