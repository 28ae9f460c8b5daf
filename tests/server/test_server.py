"""End to end over real HTTP: `aphrodite serve` with the tiny Qwen2.5-VL, driven by the
official `openai` client (sync, async, streaming), curl-style raw requests and a loopback
media server whose hit counter proves what was (not) fetched."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
import urllib.request
from pathlib import Path

import openai
import pytest
from PIL import Image

from engine.version import __version__
from tests.engine_fixtures import hf_prompt_ids, loaded
from tests.engines import ENGINES
from tests.fixtures import MediaHost, synthetic

KEY = "sekret"
OTHER_KEY = "another-tenant"  # (the server salts each key's cached work apart)
#: ours; for the tests marked ``engines``, vLLM's engine under this server's front door too
#: (tests/engines.py). Local files: the server's own folder (``{scratch}``, tests/served.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve(
    "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", "{scratch}",
    "--api-key", KEY, "--api-key", OTHER_KEY, "--cache-salt-per-api-key",
    "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
    "--media-io-kwargs", '{"video": {"backend": "pyav", "num_frames": 4}}',
    "--max-request-body-mb", "2", "--expose-request-timings")]


@pytest.fixture(scope="module")
def media():
    server = MediaHost({
        "/cat.jpg": (synthetic.make_image(320, 240, fmt="JPEG", seed=1), "image/jpeg"),
        "/dog.png": (synthetic.make_image(200, 150, fmt="PNG", seed=2), "image/png"),
        "/clip.mp4": (synthetic.make_video(width=128, height=96, seconds=1), "video/mp4"),
    })
    yield server
    server.stop()


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    (tmp_path_factory.mktemp("outside") / "secret.png").write_bytes(b"x")


@pytest.fixture
def local_dir(served, outside):
    """The server's allowed local folder, with local.png (and a file outside it)."""
    local = served.scratch / "local.png"
    if not local.exists():
        local.write_bytes(synthetic.make_image(100, 80, fmt="PNG", seed=3))
    return served.scratch


@pytest.fixture
def server(served):
    return served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0)


def chat(client, parts, **kwargs):
    """A greedy chat request; ignore_eos: tests count the tokens, and a random-weight model
    may pick its EOS early on another machine's float rounding."""
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=kwargs.pop("max_tokens", 4), temperature=0,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}],
        extra_body=extra, **kwargs)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def get(server, path: str) -> str:
    """The body of ``GET path``, sent with the API key."""
    req = urllib.request.Request(f"{server.base}{path}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as resp:
        return resp.read().decode()


def scrape(server) -> dict[str, float]:
    """Every sample of ``GET /metrics``, keyed by its name and labels as rendered."""
    return {key: float(value) for key, value in
            re.findall(r"^([a-z_]\w*(?:\{[^}]*\})?) (\S+)$", get(server, "/metrics"), re.M)}


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def expected_prompt_tokens(image: bytes | None, text: str) -> tuple[int, int]:
    """(prompt tokens, image placeholder tokens) the tiny model's own HF processor gives for
    one user message holding ``image`` (if any) then ``text``: the oracle the server's
    ``usage.prompt_tokens`` must meet. An image the server dropped, or processed at another
    size, gives another count."""
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
    images = [Image.open(io.BytesIO(image)).convert("RGB")] if image else None
    ids = hf_prompt_ids("qwen2_5_vl", [{"role": "user", "content": content}], images)
    pad = loaded("qwen2_5_vl").tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return len(ids), ids.count(pad)


def assert_one_image_went_in(server, before: dict[str, float], reply, image: bytes,
                             text: str) -> None:
    """The reply's prompt is the text plus this image's placeholder expansion, the server
    fetched exactly the image's bytes, one item went through the processor cache, and the
    vision encoder ran for the request."""
    want, image_tokens = expected_prompt_tokens(image, text)
    text_only, _ = expected_prompt_tokens(None, text)
    assert image_tokens > 0 and want > text_only + image_tokens  # the oracle counts the image
    assert reply.usage.prompt_tokens == want
    after = scrape(server)
    assert delta(after, before, 'aphrodite_media_bytes_fetched_total{modality="image"}') == \
        len(image)
    hits = reply.model_extra["aphrodite"]["cache_hits"]
    assert len(hits) == 1
    result = "hit" if hits[0] else "miss"
    assert delta(after, before, f'aphrodite_processor_cache_total{{result="{result}"}}') == 1
    assert reply.model_extra["aphrodite"]["timings"]["encoder_s"] > 0


def test_image_by_http_url(server, client, media):
    before, metrics = media.hits["/cat.jpg"], scrape(server)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-qwen2_5_vl", max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [image_part(f"{media.base}/cat.jpg"),
                                               {"type": "text", "text": "Describe."}]}])
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    # its pixel values went to the engine through /dev/shm: the engine took the segment
    api = raw.headers["x-aphrodite-api-server"]
    assert not list(Path("/dev/shm").glob(f"aphrodite-media-{api}-in-*"))
    assert media.hits["/cat.jpg"] == before + 1
    assert_one_image_went_in(server, metrics, reply, media.files["/cat.jpg"][0], "Describe.")
    timings = json.loads(raw.headers["x-aphrodite-timings"])
    assert timings == reply.model_extra["aphrodite"]["timings"]
    assert timings["fetch_s"] > 0 and timings["processor_s"] > 0 and timings["prefill_s"] > 0
    assert timings["fetch_s"] + timings["processor_s"] <= timings["server_total_s"]


def test_image_by_data_url_and_local_file(server, client, local_dir):
    png = synthetic.make_image(64, 48, fmt="PNG", seed=9)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    before = scrape(server)
    reply = chat(client, [image_part(data_url)])
    assert reply.usage.completion_tokens == 4
    assert_one_image_went_in(server, before, reply, png, "What?")
    before = scrape(server)
    reply = chat(client, [image_part(f"file://{local_dir}/local.png")])
    assert reply.usage.completion_tokens == 4
    assert_one_image_went_in(server, before, reply, (local_dir / "local.png").read_bytes(),
                             "What?")
    # The same words without an image: the image's placeholder tokens are the difference.
    text_only = chat(client, [], max_tokens=1).usage.prompt_tokens
    assert text_only == expected_prompt_tokens(None, "What?")[0]
    assert reply.usage.prompt_tokens - text_only == expected_prompt_tokens(
        (local_dir / "local.png").read_bytes(), "What?")[1] + 2  # + vision start/end markers


def test_warm_request_hits_the_processor_cache(client, media):
    parts = [image_part(f"{media.base}/dog.png")]
    first = chat(client, parts, max_tokens=3)
    second = chat(client, parts, max_tokens=3)
    assert first.model_extra["aphrodite"]["cache_hits"] == [False]
    assert second.model_extra["aphrodite"]["cache_hits"] == [True]
    assert first.choices[0].message.content == second.choices[0].message.content


def test_async_client(server, media):
    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=KEY) as c:
            replies = await asyncio.gather(*(c.chat.completions.create(
                model="tiny-qwen2_5_vl", max_tokens=3, temperature=0,
                extra_body={"ignore_eos": True}, messages=[{
                    "role": "user", "content": [image_part(f"{media.base}/cat.jpg"),
                                                {"type": "text", "text": f"Q{i}"}]}])
                for i in range(3)))
            return [r.choices[0].finish_reason for r in replies]

    assert asyncio.run(run()) == ["length"] * 3


@pytest.mark.engines(*ENGINES)
def test_streaming_matches_non_streaming(client, media):
    parts = [image_part(f"{media.base}/cat.jpg")]
    whole = chat(client, parts, max_tokens=6).choices[0].message.content
    chunks = list(chat(client, parts, max_tokens=6, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 6
    assert "timings" in chunks[-1].model_extra["aphrodite"]


def test_video_by_url_with_backend_choice(client, media):
    reply = client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"{media.base}/clip.mp4"}},
            {"type": "text", "text": "What happens?"}]}],
        extra_body={"ignore_eos": True,
                    "media_io_kwargs": {"video": {"backend": "torchcodec", "num_frames": 4}}})
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-qwen2_5_vl", max_tokens=3,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"{media.base}/clip.mp4"}}]}],
            extra_body={"media_io_kwargs": {"video": {"backend": "pynvvideocodec"}}})
    assert info.value.body["code"] == "video_backend_not_enabled"


@pytest.mark.parametrize("case", ["over-limit", "disallowed-domain", "outside-local-path",
                                  "file-without-host-rule", "metadata-address"])
def test_policy_refusals_fetch_nothing(client, media, local_dir, case):
    port = media.base.rsplit(":", 1)[1]
    parts = {
        "over-limit": [image_part(f"{media.base}/cat.jpg")] * 3,
        "disallowed-domain": [image_part(f"http://localhost:{port}/cat.jpg")],
        "outside-local-path": [image_part(f"file://{local_dir}/../outside/secret.png")],
        "file-without-host-rule": [image_part(f"file://otherhost{local_dir}/local.png")],
        "metadata-address": [image_part("http://169.254.169.254/latest/meta-data/x.png"),
                             image_part(f"{media.base}/cat.jpg")],
    }[case]
    before = media.total
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, parts)
    assert info.value.status_code == 400
    assert media.total == before  # not one byte was fetched for the refused request


@pytest.mark.parametrize(("payload", "error", "code"), [
    (b"<html>not a picture</html>", openai.BadRequestError, "unsupported_media_type"),
    (None, openai.UnprocessableEntityError, "media_decode_failed")])
def test_media_errors_raise_the_openai_clients_own_exceptions(client, payload, error, code):
    """Media that is not what its part says is a 400 (the openai package's BadRequestError;
    415 would be a bare APIStatusError); a JPEG cut short is a 422 (UnprocessableEntityError)
    so a client can tell a wrong request from a broken file."""
    if payload is None:
        buf = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="JPEG")
        payload, mime = buf.getvalue()[:300], "image/jpeg"
    else:
        mime = "image/png"
    url = f"data:{mime};base64," + base64.b64encode(payload).decode()
    with pytest.raises(error) as info:
        chat(client, [image_part(url)])
    assert info.value.body["code"] == code


def test_errors_have_the_openai_shape_and_status(server):
    def post(body: bytes, headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{server.base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    auth = {"Authorization": f"Bearer {KEY}"}
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert post(good.encode(), {})[0] == 401
    assert post(b"{not json", auth)[0] == 400
    status, body = post(json.dumps({"model": "gpt-4", "messages": []}).encode(), auth)
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 3_000_000}]}).encode()
    status, body = post(big, auth)
    assert status == 413 and "--max-request-body-mb" in body["error"]["message"]
    status, body = post(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "image": "x"}]}]}).encode(), auth)
    assert status == 400 and body["error"]["code"] == "invalid_content_part"
    status, body = post(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 10**6}).encode(), auth)
    assert status == 400 and body["error"]["param"] == "max_tokens"
    for _, body in [post(b"{not json", auth)]:
        assert "Traceback" not in json.dumps(body) and "0x" not in json.dumps(body)


def test_header_with_space_before_colon_is_a_plain_400(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization : Bearer sekret\r\nContent-Length: 2\r\n\r\n{}")
        reply = sock.recv(4096).decode(errors="replace")
    assert reply.split("\r\n", 1)[0].split(" ")[1] == "400"
    assert "Invalid header token" in reply  # the HTTP spec's rejection, not an API error


def test_models_health_version_metrics_and_text_completions(server, client):
    assert [m.id for m in client.models.list()] == ["tiny-qwen2_5_vl"]
    with urllib.request.urlopen(f"{server.base}/health") as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
    assert json.loads(get(server, "/version")) == {"version": __version__}
    before = scrape(server)
    text = client.completions.create(model="tiny-qwen2_5_vl", prompt="Once upon a time",
                                     max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0
                      ).completions.create(model="tiny-qwen2_5_vl", prompt="x", max_tokens=1)
    metrics = get(server, "/metrics")
    for name in ("aphrodite_requests_total", "aphrodite_stage_seconds",
                 "aphrodite_processor_cache_total", "aphrodite_media_bytes_fetched_total",
                 "aphrodite_video_decode_seconds", "aphrodite_gpu_decode_budget_bytes_in_use",
                 'python_gc_objects_collected_total{generation="2"}',
                 "aphrodite_heap_in_use_bytes", "aphrodite_heap_free_bytes",
                 "process_resident_memory_bytes"):
        assert name in metrics
    # The engine process's numbers come over its socket at scrape time.
    engine = dict(re.findall(r"^aphrodite_engine_(\w+) (\S+)$", metrics, re.M))
    assert float(engine["rss_bytes"]) > float(engine["heap_in_use_bytes"]) > 10 << 20
    # A real reading of the engine's collector (it has run: importing torch makes cycles),
    # and nothing left in flight once every request of this module has been answered.
    collected = float(engine["gc_objects_collected"])
    assert collected > 0 and collected.is_integer()
    assert float(engine["requests_in_flight"]) == 0
    # The counters count exactly what this test did: one good and one refused completion,
    # and the good one's prefill and decode stages.
    after = scrape(server)
    route = 'route="/v1/completions"'
    assert delta(after, before, f'aphrodite_requests_total{{{route},status="200"}}') == 1
    assert delta(after, before, f'aphrodite_requests_total{{{route},status="401"}}') == 1
    for stage in ("prefill", "decode"):
        assert delta(after, before, f'aphrodite_stage_seconds_count{{stage="{stage}"}}') == 1


def test_media_probe_refuses_and_accepts_exactly_as_serve(client, media, local_dir):
    """The same URLs through `aphrodite media probe` (same policy flags) and through serve."""
    import subprocess
    import sys
    from pathlib import Path

    port = media.base.rsplit(":", 1)[1]
    urls = [f"{media.base}/cat.jpg", f"http://localhost:{port}/cat.jpg",
            f"file://{local_dir}/local.png", f"file://{local_dir}/../outside/secret.png",
            "data:image/png;base64,!!!!", "gopher://example.com/a.png",
            f"{media.base}/missing.png"]
    flags = ["--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path",
             str(local_dir), "--modality", "image", "--json"]
    aphrodite = str(Path(sys.executable).with_name("aphrodite"))
    outcomes = []
    for url in urls:
        probe = json.loads(subprocess.run([aphrodite, "media", "probe", url, *flags],
                                          capture_output=True, text=True, timeout=120).stdout)
        try:
            chat(client, [image_part(url)], max_tokens=1)
            served = "ok"
        except openai.APIStatusError as err:
            served = err.body["code"]
        probed = "ok" if probe["ok"] else probe["error"]["code"]
        assert probed == served, url
        outcomes.append(served)
    # Not only the same answer from both: the answer the policy's rules give each URL.
    assert outcomes == ["ok", "media_domain_not_allowed", "ok", "media_local_path_outside",
                        "media_data_url_malformed", "media_scheme_not_allowed",
                        "media_fetch_status"]


@pytest.mark.parametrize(("param", "value"), [
    ("best_of", 2), ("echo", True), ("suffix", "x")])
@pytest.mark.engines(*ENGINES)
def test_openai_parameters_not_implemented_are_refused_by_name(client, param, value):
    """A client asking for what the server does not do must not get plain text as if it
    had been honoured: a 400 naming the parameter. Their "unused" values pass."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-qwen2_5_vl", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}], extra_body={param: value})
    assert info.value.body["param"] == param
    assert info.value.body["code"] == "unsupported_parameter"
    reply = client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
        extra_body={"response_format": {"type": "text"}, "best_of": 1, "echo": False,
                    "logprobs": False, "tools": [], "ignore_eos": True})
    assert reply.usage.completion_tokens == 2


@pytest.mark.engines(*ENGINES)
def test_served_sampling_parameters_shape_the_tokens(client, engine):
    """logit_bias (the openai client's own argument) forces its token at temperature 1;
    vLLM's stop_token_ids end the row there; an id out of the vocabulary is a 400 naming the
    field, on chat and completions both. The stop token that ended a row, and an EOS, count
    in completion_tokens (whole and streamed) and add no text, on both engines (vLLM's
    count: a bench's output tokens are the same against either server)."""
    forced = client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
        temperature=1, logit_bias={"77": 100}, presence_penalty=0.1, frequency_penalty=-0.1,
        logprobs=True)
    assert [t.token for t in forced.choices[0].logprobs.content] == [
        forced.choices[0].logprobs.content[0].token] * 5
    stopped = client.completions.create(
        model="tiny-qwen2_5_vl", prompt=[1, 2, 3], max_tokens=8, temperature=0,
        logit_bias={"77": 100}, extra_body={"stop_token_ids": [77], "min_tokens": 0})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    assert stopped.choices[0].stop_reason == 77  # vLLM's: the stop token that ended it
    assert stopped.usage.completion_tokens == 1
    eos = 2  # the tiny model's generation_config EOS
    ended = client.completions.create(
        model="tiny-qwen2_5_vl", prompt="hi", max_tokens=8, temperature=1,
        logit_bias={str(eos): 100})
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].text == ""
    assert ended.usage.completion_tokens == 1
    chunks = list(client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        temperature=1, logit_bias={str(eos): 100}, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 1
    for create, extra in ((client.chat.completions.create,
                           {"messages": [{"role": "user", "content": "hi"}]}),
                          (client.completions.create, {"prompt": "hi"})):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny-qwen2_5_vl", max_tokens=2, logit_bias={"100000": 1}, **extra)
        assert info.value.body["param"] == "logit_bias"
        assert "out of the vocabulary" in info.value.body["message"]


def test_stop_reason_names_the_stop_string_in_json_and_stream(client):
    """vLLM's stop_reason: the stop string that ended a choice (chat and completions, whole
    and streamed, in the chunk that ends it); null when it ran to max_tokens."""
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="tiny-qwen2_5_vl", max_tokens=8,
                                           temperature=0, messages=messages,
                                           extra_body={"ignore_eos": True})
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length"
    assert "stop_reason" in plain.choices[0].model_extra and plain.choices[0].stop_reason is None
    stop = text[1:3]  # (the tiny model's text repeats: it comes early)
    cut = client.chat.completions.create(model="tiny-qwen2_5_vl", max_tokens=8, temperature=0,
                                         messages=messages, stop=[stop, "never"],
                                         extra_body={"ignore_eos": True})
    assert (cut.choices[0].finish_reason, cut.choices[0].stop_reason) == ("stop", stop)
    chunks = list(client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=8, temperature=0, messages=messages,
        stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].stop_reason == stop
    assert all("stop_reason" not in (c.choices[0].model_extra or {})
               for c in chunks if c.choices and not c.choices[0].finish_reason)
    prompt = client.completions.create(model="tiny-qwen2_5_vl", prompt="hi", max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    stop = prompt.choices[0].text[1:3]
    cut = client.completions.create(model="tiny-qwen2_5_vl", prompt="hi", max_tokens=8,
                                    temperature=0, stop=stop, stream=True,
                                    extra_body={"ignore_eos": True})
    ends = [c.choices[0] for c in cut if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].stop_reason == stop


def test_models_by_id_and_405_says_allow(server, client):
    assert client.models.retrieve("tiny-qwen2_5_vl").id == "tiny-qwen2_5_vl"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    req = urllib.request.Request(f"{server.base}/v1/chat/completions",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 405 and "POST" in info.value.headers["Allow"]


def test_vllm_metric_names_count_what_was_served(server, client, media):
    """Dashboards built for vLLM read this server: vLLM's metric names with model_name,
    counting exactly the tokens the answers' usage reported, the gaps between them, the
    requests' waits in the engine and the media the processor cache was asked for."""
    def scrape() -> dict[str, float]:
        req = urllib.request.Request(f"{server.base}/metrics",
                                     headers={"Authorization": f"Bearer {KEY}"})
        text = urllib.request.urlopen(req).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^(vllm:[a-z0-9_]+)\{model_name="tiny-qwen2_5_vl"\} (\S+)$', text, re.M)}

    before = scrape()
    # ignore_eos: the counts are the point, and a random-weight model may pick its EOS early
    one = client.chat.completions.create(model="tiny-qwen2_5_vl", max_tokens=3, messages=[
        {"role": "user", "content": "one"}], extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        model="tiny-qwen2_5_vl", max_tokens=2, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "two"}])
    usage = [c.usage for c in stream if c.usage][-1]
    # the second is a processor cache hit whatever came before
    images = [chat(client, [image_part(f"{media.base}/cat.jpg")], max_tokens=1).usage
              for _ in range(2)]
    after = scrape()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:generation_tokens_total"] == one.usage.completion_tokens + \
        usage.completion_tokens + 2 == 7
    assert delta["vllm:prompt_tokens_total"] == one.usage.prompt_tokens + usage.prompt_tokens \
        + sum(u.prompt_tokens for u in images)
    for name in ("vllm:e2e_request_latency_seconds_count",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert delta[name] == 4, name
    assert delta["vllm:time_per_output_token_seconds_count"] == 2  # (not for 1 token)
    assert delta["vllm:inter_token_latency_seconds_count"] == (3 - 1) + (2 - 1)
    assert delta["vllm:mm_cache_queries_total"] == 2 and delta["vllm:mm_cache_hits_total"] >= 1
    assert after["vllm:num_preemptions_total"] == 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0


def test_model_card_names_where_the_weights_came_from(server, client):
    """vLLM's ``root``: a client (AIPerf takes its tokenizer from it) can load the served
    model's own tokenizer from there; the list and the by-id card agree."""
    from transformers import AutoTokenizer

    listed = json.loads(get(server, "/v1/models"))["data"][0]
    assert listed == json.loads(get(server, "/v1/models/tiny-qwen2_5_vl"))
    assert listed["parent"] is None and listed["max_model_len"] > 0
    tokenizer = AutoTokenizer.from_pretrained(listed["root"])
    assert tokenizer.encode("Hello") == loaded("qwen2_5_vl").tokenizer.encode("Hello")


@pytest.mark.engines(*ENGINES)
def test_ping_answers_without_a_key(server):
    for method in ("GET", "POST"):
        with urllib.request.urlopen(urllib.request.Request(f"{server.base}/ping",
                                                           method=method)) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}


@pytest.mark.engines(*ENGINES)
def test_x_request_id_names_the_answer_and_comes_back(server, client):
    """A client's X-Request-Id names the answer (``chatcmpl-<id>``, vLLM's) and is returned,
    streamed too; without one the server makes one up; a malformed one is a 400 naming it."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-qwen2_5_vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "gw-7:a.b"})
    assert raw.headers["x-request-id"] == "gw-7:a.b"
    assert raw.parse().id == "chatcmpl-gw-7:a.b"
    with client.chat.completions.with_streaming_response.create(
            model="tiny-qwen2_5_vl", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s1"}) as streamed:
        assert streamed.headers["x-request-id"] == "s1"
        assert all(chunk.id == "chatcmpl-s1" for chunk in streamed.parse())
    made_up = client.models.with_raw_response.list().headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{24}", made_up)
    for bad in ("two words", "x" * 129, "caf\u00e9"):
        req = urllib.request.Request(
            f"{server.base}/v1/models",
            headers={"Authorization": f"Bearer {KEY}",
                     "X-Request-Id": bad.encode().decode("latin-1")})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req)
        body = json.loads(info.value.read())
        assert info.value.code == 400 and body["error"]["param"] == "X-Request-Id", body


@pytest.mark.engines(*ENGINES)
def test_continuous_usage_stats_puts_usage_on_every_chunk(server, client):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it on every stream, AIPerf's
    --per-chunk-usage needs it): each token's chunk carries the usage so far."""
    stream = client.chat.completions.create(
        model="tiny-qwen2_5_vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"continuous_usage_stats": True})
    chunks = list(stream)
    with_tokens = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_tokens] == [1, 2, 3, 4]
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-qwen2_5_vl", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1, stream=True, stream_options={"continuous_usage_stats": "yes"})
    assert info.value.body["param"] == "stream_options.continuous_usage_stats"


def post(server, path: str, body: dict) -> tuple[int, dict]:
    """``POST path`` with the API key: the status and the JSON answer (errors included)."""
    req = urllib.request.Request(f"{server.base}{path}", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenize_counts_what_the_generation_routes_report(server, client, media):
    """vLLM's /tokenize: a chat with an image counts its media tokens, the same number the
    chat request reports as prompt tokens; a prompt counts as /v1/completions does, and
    /detokenize gives its text back."""
    parts = [image_part(f"{media.base}/cat.jpg"), {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": parts}]
    status, counted = post(server, "/tokenize", {"model": "tiny-qwen2_5_vl",
                                                 "messages": messages})
    assert status == 200, counted
    assert counted["count"] == chat(client, parts[:1], max_tokens=1).usage.prompt_tokens
    assert counted["count"] == len(counted["tokens"]) and counted["token_strs"] is None
    status, counted = post(server, "/tokenize", {"prompt": "Once upon a time",
                                                 "return_token_strs": True})
    reported = client.completions.create(model="tiny-qwen2_5_vl", prompt="Once upon a time",
                                         max_tokens=1).usage.prompt_tokens
    assert status == 200 and counted["count"] == reported == len(counted["token_strs"])
    assert post(server, "/detokenize", {"tokens": counted["tokens"]}) == (
        200, {"prompt": "Once upon a time"})


def test_chat_template_kwargs_reach_the_template(server, client, media):
    """vLLM's chat_template_kwargs: Qwen-VL's template numbers the pictures with
    ``add_vision_id`` (in /tokenize's count and tokens, and in the chat's prompt_tokens); a
    name the server sets itself is a 400 naming it; /v1/completions renders no template and
    refuses them; a name the template does not read changes nothing."""
    parts = [image_part(f"{media.base}/cat.jpg"), {"type": "text", "text": "What?"}]
    body = {"model": "tiny-qwen2_5_vl", "messages": [{"role": "user", "content": parts}],
            "return_token_strs": True}
    status, plain = post(server, "/tokenize", body)
    assert status == 200, plain
    status, numbered = post(server, "/tokenize", {
        **body, "chat_template_kwargs": {"add_vision_id": True}})
    assert status == 200, numbered
    assert numbered["count"] > plain["count"]
    assert "Picture" in "".join(numbered["token_strs"]) and "Picture" not in "".join(
        plain["token_strs"])
    asked = chat(client, parts[:1], max_tokens=1,
                 extra_body={"chat_template_kwargs": {"add_vision_id": True}})
    assert asked.usage.prompt_tokens == numbered["count"]
    unread = chat(client, parts[:1], max_tokens=1,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert unread.usage.prompt_tokens == plain["count"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, parts[:1], extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.body["param"] == "chat_template_kwargs"
    assert "'messages' is set by the server" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-qwen2_5_vl", prompt="hi", max_tokens=1,
                                  extra_body={"chat_template_kwargs": {"a": 1}})
    assert info.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/detokenize", {"tokens": [1 << 40]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_refusals_name_the_field(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def tokens_of(reply) -> list[str]:
    return [t.token for t in reply.choices[0].logprobs.content]


@pytest.mark.engines(*ENGINES)
def test_a_uuid_alone_answers_as_the_part_with_its_media_did(server, client):
    """vLLM's media uuid: a part with its media and a uuid names that content; a later part
    with ``"image_url": null`` and the uuid alone is answered token for token as the media
    was. Sent again with another image, the uuid names that one (its own answer, never the
    first image's features); another tenant (API key or cache_salt) cannot name it, nor can a
    uuid never sent: a 400 naming the part's uuid."""
    images = ["data:image/png;base64," + base64.b64encode(
        synthetic.make_image(96, 80, fmt="PNG", seed=seed)).decode() for seed in (41, 42)]
    ids = {"logprobs": True, "max_tokens": 6,
           "extra_body": {"return_tokens_as_token_ids": True}}

    def ask(image: str | None, uuid: str = "sku-41", salt: str | None = None, who=client):
        ref = {"url": image} if image else None
        extra = {**ids, "extra_body": {**ids["extra_body"], **(
            {"cache_salt": salt} if salt else {})}}
        return chat(who, [{"type": "image_url", "image_url": ref, "uuid": uuid}], **extra)

    first = ask(images[0])
    alone = ask(None)
    assert tokens_of(alone) == tokens_of(first) and len(tokens_of(first)) == 6
    assert alone.usage.prompt_tokens == first.usage.prompt_tokens
    assert alone.model_extra["aphrodite"]["cache_hits"] == [True]  # the same content key
    second = ask(images[1])  # the same uuid, other content: it now names this image
    assert second.model_extra["aphrodite"]["cache_hits"] == [False]
    assert tokens_of(ask(None)) == tokens_of(second)
    other = openai.OpenAI(base_url=f"{server.base}/v1", api_key=OTHER_KEY, max_retries=0)
    for who, uuid, salt in ((other, "sku-41", None), (client, "sku-41", "another-tenant"),
                            (client, "never-sent", None)):
        with pytest.raises(openai.BadRequestError) as info:
            ask(None, uuid, salt, who)
        error = info.value.body
        assert error["param"] == "messages[0].content[0].uuid"
        assert error["code"] == "unknown_media_uuid"
        assert repr(uuid) in error["message"] and "evicted" in error["message"]


@pytest.mark.engines(*ENGINES)
def test_each_api_key_is_a_tenant_of_its_own(server, client):
    """--cache-salt-per-api-key: the same request from another key finds nothing of the
    first key's in the prefix cache (cached_tokens 0), and its own repeat finds itself."""
    other = openai.OpenAI(base_url=f"{server.base}/v1", api_key=OTHER_KEY, max_retries=0)
    text = "Tell me, in as many words as it takes, what a tenant is and is not. " * 3

    def cached(who) -> int:
        reply = who.chat.completions.create(
            model="tiny-qwen2_5_vl", max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": text}, {"role": "user", "content": "?"}],
            extra_body={"ignore_eos": True})  # (its own system text: no other test's blocks)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(client) == 0
    assert cached(client) > 0
    assert cached(other) == 0
    assert cached(other) > 0
