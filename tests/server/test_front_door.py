"""The front door of a real `aphrodite serve`: the key is checked before any slot is taken,
bodies arrive under a deadline, only JSON is read, no client input is ever a 500."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.request

import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.errors import AphroditeError
from engine.server.api.admin_routes import Access
from engine.server.api.app import error_response
from engine.server.api.front_door import MAX_DEPTH, auth_middleware, key_matches, parse_body
from engine.server.api.tenants import KEY_SALT, key_salt

KEY = "front-door-key"
ADMIN_KEY = "front-door-admin-key"
BODY_TIMEOUT_S = 2
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve(
    "--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--max-pending-requests", "2",
    "--request-body-timeout-s", str(BODY_TIMEOUT_S), "--max-request-body-mb", "1")]


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark, tests/served.py)."""
    return served


def call(server, path: str, body: bytes | None = None, headers: dict | None = None,
         method: str | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request(method or ("POST" if body is not None else "GET"), path, body=body,
                     headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {"raw": raw[:200].decode(errors="replace")}
        return resp.status, dict(resp.headers), doc
    finally:
        conn.close()


def keyed(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
            **(extra or {})}


def chat(text: str = "hi", **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                       **fields}).encode()


def half_sent(server, key: str | None) -> socket.socket:
    """A connection that sent its headers (a 100-byte body announced) and no body."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
                 f"application/json\r\nContent-Length: 100\r\n\r\n".encode())
    return sock


def status_of(sock: socket.socket, timeout: float = 60) -> int:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_keyless_slow_bodies_take_no_slot(server):
    """Without the key a half-sent request is refused from its headers (401 at once), so a
    crowd of them cannot hold the pending slots: a keyed client is served meanwhile."""
    socks = [half_sent(server, None) for _ in range(6)]
    try:
        assert [status_of(s) for s in socks] == [401] * 6
        status, _, doc = call(server, "/v1/chat/completions", chat(), keyed())
        assert status == 200, doc
    finally:
        for s in socks:
            s.close()


def test_a_body_that_never_arrives_is_a_408_and_frees_its_slot(server):
    """Keyed clients that withhold their body hold a slot only until the body deadline:
    while they hold both slots a third request is a 503; then each gets a 408 naming the
    flag, and the server serves again."""
    socks = [half_sent(server, KEY) for _ in range(2)]
    try:
        # Both are admitted once the server has read their headers; a third is refused.
        # (Admission happens before the body read, so this is deterministic once the
        # headers are in: poll /metrics-free status by retrying until the 503 shows.)
        status, headers, doc = call(server, "/v1/chat/completions", chat(), keyed())
        for _ in range(50):
            if status == 503:
                break
            status, headers, doc = call(server, "/v1/chat/completions", chat(), keyed())
        assert status == 503 and headers["Retry-After"] == "1", doc
        assert [status_of(s) for s in socks] == [408, 408]
    finally:
        for s in socks:
            s.close()
    status, _, doc = call(server, "/v1/chat/completions", chat(), keyed())
    assert status == 200, doc


def test_408_names_the_rule_and_the_flag(server):
    """...and arrives at the configured deadline (2 s here), not the 30 s default."""
    sock = half_sent(server, KEY)
    sent = time.monotonic()
    try:
        sock.settimeout(60)
        raw = b""
        while not raw.endswith(b"}}") and len(raw) < 10_000:
            chunk = sock.recv(4096)
            if not chunk:
                break
            raw += chunk
    finally:
        sock.close()
    waited = time.monotonic() - sent
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert BODY_TIMEOUT_S - 0.5 <= waited < 25, waited  # the flag reached the server
    error = json.loads(body)["error"]
    assert error["code"] == "request_body_timeout"
    assert "--request-body-timeout-s" in error["message"]


def test_401_says_bearer_and_the_scheme_is_case_insensitive(server):
    status, headers, doc = call(server, "/v1/chat/completions", chat(),
                                {"Content-Type": "application/json"})
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert doc["error"]["code"] == "invalid_api_key"
    for spelling in ("bearer", "BEARER", "Bearer"):
        status, _, doc = call(server, "/v1/chat/completions", chat(),
                              {"Authorization": f"{spelling} {KEY}",
                               "Content-Type": "application/json"})
        assert status == 200, (spelling, doc)
    status, _, _ = call(server, "/v1/chat/completions", chat(),
                        {"Authorization": f"Bearer {KEY}x", "Content-Type": "application/json"})
    assert status == 401


def test_models_metrics_and_version_need_the_key_health_does_not(server):
    for path in ("/v1/models", "/metrics", "/version"):
        status, headers, _ = call(server, path)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", path
        assert call(server, path, headers={"Authorization": f"Bearer {KEY}"})[0] == 200, path
    assert call(server, "/health")[0] == 200


def test_the_cache_resets_take_the_admin_key_alone(server):
    """``POST /reset_mm_cache`` and ``/reset_prefix_cache`` empty caches every client shares:
    with ``--admin-api-key`` they take that key, never a user's; with it they still take the
    API's checks (a cross-site form is a 415, another site's Origin a 403)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for path in ("/reset_mm_cache", "/reset_prefix_cache"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
            status, sent, doc = call(server, path, body=b"", method="POST", headers=headers)
            assert status == 401 and sent["WWW-Authenticate"] == "Bearer", (path, doc)
            assert "--admin-api-key" in doc["error"]["message"]
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):
            status, _, doc = call(server, path, body=b"a=1", method="POST",
                                  headers={**admin, "Content-Type": ctype,
                                           "Origin": "http://evil.example"})
            assert status == 415 and doc["error"]["code"] == "unsupported_content_type", doc
        status, _, doc = call(server, path, body=b"", method="POST",
                              headers={**admin, "Origin": "http://evil.example"})
        assert status == 403 and doc["error"]["code"] == "cross_origin_request", doc
        status, _, doc = call(server, path, body=b"", method="POST",
                              headers={**admin, "Origin": f"http://127.0.0.1:{server.port}"})
        assert status == 200, (path, doc)


def test_the_engine_process_side_of_a_reset_needs_no_web_framework():
    """The engine process carries resets out (engine.server.process.cache_reset): importing it and
    the engine process's module brings in no aiohttp (its import held the engine's GIL for
    half a second at the first reset of a run)."""
    import subprocess
    import sys

    code = ("import sys, engine.server.process.engine_proc, engine.server.process.cache_reset; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_json_is_415(server, ctype):
    """A browser can POST these cross-site without a preflight; the API reads only JSON."""
    status, _, doc = call(server, "/v1/chat/completions", chat(), keyed({"Content-Type": ctype}))
    assert status == 415 and doc["error"]["code"] == "unsupported_content_type"


def test_no_content_type_is_read_as_json(server):
    """curl -d without -H sends a form type (415 above); a client sending none is read."""
    status, _, doc = call(server, "/v1/chat/completions", chat(),
                          {"Authorization": f"Bearer {KEY}"})
    assert status == 200, doc


BAD_BODIES = {
    "5000-digit integer": b'{"messages": [{"role": "user", "content": "hi"}], "seed": '
                          + b"9" * 5000 + b"}",
    "deep nesting": b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested past the limit": b'{"x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
                             + b"}",
    "lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "seed over 64 bits": chat(seed=1 << 64),
    "seed just past int64": chat(seed=1 << 63),
    "NaN": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    "role is a list": b'{"messages": [{"role": ["user"], "content": "hi"}]}',
    "role is an object": b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}',
    "part type is a list": b'{"messages": [{"role": "user", "content": [{"type": ["text"], '
                           b'"text": "hi"}]}]}',
    "URL authority []@": json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://[]@/x.png"}}]}]}).encode(),
    "not UTF-8": b'{"messages": "\xff\xfe"}',
    "kwarg of the wrong type": chat(mm_processor_kwargs={"max_pixels": "many"}),
    "patch size changed per request": chat(mm_processor_kwargs={"patch_size": 8}),
    "pixel bomb by kwargs (float)": chat(mm_processor_kwargs={"min_pixels": 1e8}),
    "pixel bomb by kwargs (int)": chat(mm_processor_kwargs={"min_pixels": 100_000_000}),
    "min over max": chat(mm_processor_kwargs={"min_pixels": 6000, "max_pixels": 5000}),
    "pixel bomb by kwargs (max_pixels)": chat(mm_processor_kwargs={"max_pixels": 100_000_000}),
    "fps bomb": chat(mm_processor_kwargs={"fps": 1e6}),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_input_is_a_400_never_a_500(server, name):
    status, _, doc = call(server, "/v1/chat/completions", BAD_BODIES[name], keyed())
    assert status == 400, (name, doc)
    if "kwarg" in name or "pixel" in name or "fps" in name or "patch" in name:
        assert doc["error"]["code"] == "invalid_mm_processor_kwargs", doc
    assert doc["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in doc["error"]["message"]


def test_a_request_may_lower_the_pixel_budget(server):
    """Fewer pixels than the server's own maximum is the kwargs' legitimate use."""
    import base64

    from tests.fixtures import synthetic

    png = synthetic.make_image(200, 150, fmt="PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    tokens = {}
    for max_pixels in (None, 28 * 28 * 4):
        extra = {"mm_processor_kwargs": {"max_pixels": max_pixels}} if max_pixels else {}
        body = json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 1, **extra})
        status, _, doc = call(server, "/v1/chat/completions", body.encode(), keyed())
        assert status == 200, doc
        tokens[max_pixels] = doc["usage"]["prompt_tokens"]
    assert tokens[28 * 28 * 4] < tokens[None]


def text_of(server, **fields) -> str:
    status, _, doc = call(server, "/v1/chat/completions", chat("Tell me a story.", **fields),
                          keyed())
    assert status == 200, (fields, doc)
    return doc["choices"][0]["message"]["content"]


@pytest.mark.parametrize("field", [
    {"temperature": 1e-45}, {"temperature": 5e-324}, {"temperature": 1e-38},
    {"temperature": 1e-46}, {"top_p": 1e-45}, {"top_p": 1e-46}, {"top_p": 1e-300}])
def test_float32_edge_temperature_and_top_p_are_served(server, field):
    """Values that pass validation and are subnormal, tiny or underflow in float32 are
    served as documented: a temperature below 1e-5 is greedy (vLLM's _SAMPLING_EPS), a
    top_p that keeps less than the most likely token keeps that one: greedy too."""
    fields = {"max_tokens": 6, "ignore_eos": True, "seed": 3}
    greedy = text_of(server, temperature=0, **fields)
    assert text_of(server, **{"temperature": 1.0, **field}, **fields) == greedy


def test_every_bit_of_a_seed_counts(server):
    """torch's CPU generator keeps a seed's low 32 bits; seeds that differ above them drew
    the same tokens. Same seed, same text; any other accepted seed, another."""
    fields = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    texts = {seed: text_of(server, seed=seed, **fields)
             for seed in (1, 1 + (1 << 32), 1 + (1 << 62), -1, (1 << 63) - 1)}
    assert len(set(texts.values())) == len(texts), texts
    assert text_of(server, seed=1 + (1 << 32), **fields) == texts[1 + (1 << 32)]


def test_a_requests_video_fps_takes_effect(server):
    """``mm_processor_kwargs.fps`` samples that many frames per second (Hugging Face's
    meaning): a 2 s clip at fps 1 is fewer video tokens than at fps 8, and the request's
    ``media_io_kwargs.video.fps`` wins over it. It was accepted and changed nothing."""
    import base64

    from tests.fixtures import synthetic

    clip = synthetic.make_video(width=64, height=48, seconds=2, fps=8)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()

    def prompt_tokens(**extra) -> int:
        body = json.dumps({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}]}], "max_tokens": 1, **extra})
        status, _, doc = call(server, "/v1/chat/completions", body.encode(), keyed())
        assert status == 200, (extra, doc)
        return doc["usage"]["prompt_tokens"]

    one, eight = (prompt_tokens(mm_processor_kwargs={"fps": fps}) for fps in (1, 8))
    assert one < eight
    assert prompt_tokens(mm_processor_kwargs={"fps": 8},
                         media_io_kwargs={"video": {"fps": 1}}) == one


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=10)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "video_url",
                                                       "audio_url", "input_audio"]) | json_value},
                             optional={"text": json_value, "image_url": json_value,
                                       "video_url": json_value, "input_audio": json_value})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])
                                 | json_value,
                                 "content": st.text(max_size=12) | st.lists(part, max_size=2)
                                 | json_value})
request_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | json_value},
    optional={"max_tokens": st.integers(-2, 3) | json_value, "seed": st.integers() | json_value,
              "temperature": st.floats(allow_nan=False) | json_value, "n": json_value,
              "stream": json_value, "stop": json_value, "top_k": json_value,
              "top_p": json_value, "model": json_value, "media_io_kwargs": json_value,
              "mm_processor_kwargs": json_value, "stream_options": json_value})


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.one_of(request_body.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64)))
@example(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}')
def test_whatever_a_client_sends_the_answer_is_200_or_4xx(server, body):
    status, _, doc = call(server, "/v1/chat/completions", body, keyed())
    assert status == 200 or 400 <= status < 500, (status, doc, body[:300])
    if status != 200:
        assert set(doc["error"]) == {"message", "type", "param", "code"}


# The middleware alone, in-process: which paths are open, and the key's spelling.

@web.middleware
async def errors(request, handler):
    """As the app's: a project error is its OpenAI-shaped answer."""
    try:
        return await handler(request)
    except AphroditeError as err:
        return error_response(err)


async def test_metrics_open_only_with_the_flag(aiohttp_client):
    async def ok(request):
        return web.json_response({"ok": True})

    for flag, metrics_status in ((False, 401), (True, 200)):
        app = web.Application(middlewares=[errors, auth_middleware(KEY, flag)])
        for path in ("/health", "/metrics", "/v1/models"):
            app.router.add_get(path, ok)
        client = await aiohttp_client(app)
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == metrics_status
        assert (await client.get("/v1/models")).status == 401


async def admin_client(aiohttp_client, access: Access):
    """The admin routes in-process, behind the API's middleware, over a stand-in state (an
    engine that answers every reset)."""
    import types

    from engine.server.api.admin_routes import ADMIN_PATHS, add_admin_routes

    async def reset(what):
        return {"reset": True, "what": what}

    key = web.AppKey("state", object)
    app = web.Application(middlewares=[errors, auth_middleware(access.api_key, False,
                                                               ADMIN_PATHS)])
    app[key] = types.SimpleNamespace(
        engine=types.SimpleNamespace(reset=reset, on_reset_mm_cache=[]),
        pipeline=types.SimpleNamespace(cache=types.SimpleNamespace(clear=lambda: 0),
                                       uuids=types.SimpleNamespace(clear=lambda: 0)),
        vllm_ledger=types.SimpleNamespace(clear=lambda: 0))
    add_admin_routes(app, key, access)
    return await aiohttp_client(app)


@pytest.mark.parametrize("api_key", [None, KEY])
async def test_the_cache_resets_are_off_without_an_admin_key_or_dev_mode(aiohttp_client,
                                                                         api_key):
    """As vLLM (its resets only with VLLM_SERVER_DEV_MODE=1): a 404 naming both flags, for
    key holders too; a web page's form gets nothing either."""
    client = await admin_client(aiohttp_client, Access(api_key=api_key))
    for path in ("/reset_mm_cache", "/reset_prefix_cache"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"},
                        {"Content-Type": "text/plain", "Origin": "http://evil.example"}):
            resp = await client.post(path, headers=headers)
            doc = await resp.json()
            assert resp.status == 404 and doc["error"]["code"] == "admin_route_disabled", doc
            assert "--admin-api-key" in doc["error"]["message"]
            assert "--server-dev-mode" in doc["error"]["message"]


async def test_dev_mode_resets_take_the_apis_checks(aiohttp_client):
    """``--server-dev-mode`` on a server without any key: a script resets, a web page's
    cross-site form (text/plain, form-urlencoded, multipart) is a 415 as chat's is, and a
    body-less POST from any page (fetch in no-cors mode; a DNS-rebound page says the
    server's own origin) a 403."""
    client = await admin_client(aiohttp_client, Access(server_dev_mode=True))
    for path, what in (("/reset_mm_cache", "mm"), ("/reset_prefix_cache", "prefix")):
        resp = await client.post(path)  # (aiohttp says application/octet-stream, empty)
        assert resp.status == 200 and (await resp.json())["what"] == what
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):
            resp = await client.post(path, data=b"a=1", headers={
                "Content-Type": ctype, "Origin": "http://evil.example"})
            assert resp.status == 415, ctype
        for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example"):
            resp = await client.post(path, headers={"Origin": origin})
            doc = await resp.json()
            assert resp.status == 403 and doc["error"]["code"] == "cross_origin_request", doc
        # a page under the server's own name (or one DNS-rebound to it, whose Origin then
        # matches its Host): no key to hold it back, so no page at all
        resp = await client.post(path, headers={"Origin": f"http://{client.host}:{client.port}"})
        assert resp.status == 403 and "--admin-api-key" in (await resp.json())["error"][
            "message"]


@pytest.mark.parametrize(("header", "ok"), [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"  Bearer   {KEY} ", True),
    (f"Basic {KEY}", False), (KEY, False), (f"Bearer {KEY[:-1]}", False), ("", False),
    (None, False), (f"Bearer {KEY} extra", False)])
def test_key_matching(header, ok):
    assert key_matches(header, KEY) is ok


def test_parse_body_shape_rules():
    assert parse_body(b'{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}
    for bad in (b"[]", b'{"a": Infinity}', b'{"a": 1e999}', b'{"a": -9223372036854775809}',
                b'{"\\udfff": 1}'):
        with pytest.raises(AphroditeError) as info:
            parse_body(bad)
        assert info.value.status == 400 and info.value.code == "invalid_json", bad
    assert parse_body(b'{"a": 18446744073709551615}') == {"a": (1 << 64) - 1}


def test_urllib_against_a_wrong_key_gets_401_with_the_challenge(server):
    req = urllib.request.Request(f"{server.base}/v1/models",
                                 headers={"Authorization": "Bearer nope"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(("flags", "words"), [
    (["--device", "tpu"], "--device 'tpu' is not supported"),
    (["--device", "cuda"], "CUDA device"),
    (["--dtype", "float8"], "--dtype 'float8' is not supported")])
def test_a_device_or_dtype_that_cannot_work_is_one_line_at_start(flags, words):
    import subprocess

    from tests.server_harness import BIN, free_port

    done = subprocess.run([str(BIN), "serve", *flags, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr + done.stdout
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr


def test_timings_and_cache_hits_stay_private_by_default(server):
    """Without --expose-request-timings a client learns nothing of the server's cache (a hit
    would tell it that someone else sent the same image): no header, no body field."""
    status, headers, doc = call(server, "/v1/chat/completions", chat(), keyed())
    assert status == 200 and "aphrodite" not in doc
    assert "x-aphrodite-timings" not in {k.lower() for k in headers}
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=body, headers=keyed())
    raw = conn.getresponse().read()
    conn.close()
    assert b'"aphrodite"' not in raw and raw.rstrip().endswith(b"data: [DONE]")


async def test_the_key_middleware_lets_any_key_in_and_salts_by_it(aiohttp_client):
    """--api-key given several times: each key is let in, another is a 401; with
    --cache-salt-per-api-key the request carries its own key's salt (and no key in clear)."""
    async def salt(request: web.Request) -> web.Response:
        return web.json_response({"salt": request.get(KEY_SALT)})

    for per_key in (False, True):
        check = auth_middleware(("one", "two"), False, salt_per_key=per_key)
        app = web.Application(middlewares=[errors, check])
        app.router.add_get("/salt", salt)
        client = await aiohttp_client(app)
        for key in ("one", "two"):
            resp = await client.get("/salt", headers={"Authorization": f"Bearer {key}"})
            assert resp.status == 200
            assert (await resp.json())["salt"] == (key_salt(key) if per_key else None)
        resp = await client.get("/salt", headers={"Authorization": "Bearer three"})
        assert resp.status == 401
