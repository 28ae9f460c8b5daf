"""The request-field walk and ``--generation-config`` against a live server: each field of
vLLM's and OpenAI's request lists (tests/request_fields.json) is honoured, a label, or a 400
naming it, never a 500; unknown fields are logged once per name; the model's sampling defaults
apply where a request leaves them out. The same rules model-free:
tests/unit/test_request_fields.py."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_request_fields import base, walk, with_field, write_config


def generation_config(folder) -> None:
    """The server's ``--generation-config`` folder: greedy, 4 new tokens."""
    write_config(folder, {"temperature": 0, "max_new_tokens": 4, "eos_token_id": 2})


#: a server of its own flags (tests/served.py), its folder written before it starts
pytestmark = pytest.mark.serve("--generation-config", "{scratch}", "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes", prepare=generation_config)


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark)."""
    return served


def post(server, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.base}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if not body.get("stream") else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_served_field_walk_and_unknown_fields_logged_once(server):
    """Each field of both lists, alone with its plausible value, on both endpoints: a 200
    (honoured or a label) or a 400 naming it (refused); never a 500."""
    for chat in (True, False):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        for name, what in walk(chat):
            status, answer = post(server, path, with_field(name, chat))
            if what == "refused":
                assert (status, answer["error"]["param"]) == (400, name), (path, name)
            else:
                assert status == 200, (path, name, answer)
    for _ in range(2):
        assert post(server, "/v1/completions", {**base(False), "frobnicate": 1})[0] == 200
    assert server.output.count("unknown request field 'frobnicate'") == 1


def test_served_generation_config_defaults(server):
    """The folder's temperature 0 and max_new_tokens 4 apply where a request leaves them
    out (logged at start-up); a request's own values win."""
    assert "Default sampling parameters from" in server.output
    assert "'temperature': 0" in server.output
    body = {"model": "tiny-qwen2_5_vl", "prompt": "Once upon", "ignore_eos": True}
    texts = {post(server, "/v1/completions", {**body, "seed": s})[1]["choices"][0]["text"]
             for s in (1, 2, 3)}
    assert len(texts) == 1  # greedy whatever the seed
    assert post(server, "/v1/completions", body)[1]["usage"]["completion_tokens"] == 4
    own = post(server, "/v1/completions", {**body, "max_tokens": 6, "temperature": 1.0,
                                           "seed": 1})[1]
    assert own["usage"]["completion_tokens"] == 6
