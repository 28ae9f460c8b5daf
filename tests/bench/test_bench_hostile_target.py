"""bench serve against buggy and hostile targets: real loopback aiohttp servers that send a
50 MB SSE line, invalid JSON, usage counts as strings, an endless stream, an endless model
list, a stall, a broken connection, and terminal escape sequences, rich markup, HTML and
Markdown in their words. Each is a counted failure of its request with a type and an escaped
example; the client stays bounded, the result file is written and the exit status is 1."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

from aphrodite_cli.bench.data.datasets import parse_buckets, random_mm
from aphrodite_cli.bench.load.client import (
    LoadConfig,
    TargetConfig,
    build_payload,
    first_model,
    run_phase,
)
from aphrodite_cli.bench.load.metrics import compute
from aphrodite_cli.bench.results.escape import markdown_safe, printable, rich_safe
from engine.errors import ConfigError

#: what a hostile target puts in its words: set the terminal's title, clear the screen,
#: write the clipboard (OSC 52), an 8-bit CSI, a bidi override, rich markup, HTML, Markdown
NASTY = ("\x1b]0;owned\x07\x1b[2J\x1b]52;c;ZWNobyBvd25lZA==\x07\x9b31m\u202e [/code] "
         "<script>alert(1)</script> | **bold** [link](http://x)")
CONTROL = ("\x1b", "\x07", "\x9b", "\u202e")


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _token(text: str = " tok") -> bytes:
    return _sse({"choices": [{"index": 0, "delta": {"content": text}}]})


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def hostile_app() -> web.Application:
    """One route per misbehaviour, each under /<name>/v1/chat/completions."""
    routes: dict[str, object] = {}

    def route(name: str):
        def add(handler):
            routes[name] = handler
            return handler
        return add

    @route("long-line")
    async def long_line(request):  # one SSE line of 50 MB
        resp = await _stream(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "')
        try:
            for _ in range(50):
                await resp.write(b"x" * (1 << 20))
            await resp.write(b'"}}]}\n\n')
        except ConnectionError:  # the client hung up, as it should
            pass
        return resp

    @route("invalid-json")
    async def invalid_json(request):
        resp = await _stream(request)
        await resp.write(_token() + b"data: {\"choices\": [{\"delta\": {\"content\": \n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @route("string-usage")
    async def string_usage(request):
        resp = await _stream(request)
        await resp.write(_token() + _token() + _sse({"choices": [], "usage": {
            "prompt_tokens": "1", "completion_tokens": "2"}}) + b"data: [DONE]\n\n")
        return resp

    @route("wrong-shape")
    async def wrong_shape(request):
        resp = await _stream(request)
        await resp.write(_token() + _sse({"choices": {"0": "tok"}}) + b"data: [DONE]\n\n")
        return resp

    @route("bad-extension")
    async def bad_extension(request):  # stage timings as text: no crash in the metrics
        resp = await _stream(request)
        await resp.write(_token() + _sse({"choices": [], "aphrodite": {
            "timings": {"decode_s": "fast"}, "cache_hits": 3}}) + b"data: [DONE]\n\n")
        return resp

    @route("endless")
    async def endless(request):  # valid tokens, fast, forever
        resp = await _stream(request)
        piece = _token(" tok" * 2000)
        while True:
            await resp.write(piece)

    @route("stall")
    async def stall(request):  # one token, then nothing
        resp = await _stream(request)
        await resp.write(_token())
        await asyncio.sleep(3600)
        return resp

    @route("hang-up")
    async def hang_up(request):  # one token, then the connection is cut
        resp = await _stream(request)
        await resp.write(_token())
        request.transport.close()
        return resp

    @route("no-done")
    async def no_done(request):  # a stream that just ends
        resp = await _stream(request)
        await resp.write(_token() + _token())
        return resp

    @route("error-event")
    async def error_event(request):
        resp = await _stream(request)
        await resp.write(_token() + _sse({"error": {"message": "engine died",
                                                    "code": "internal_error"}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @route("nasty-error")
    async def nasty_error(request):
        body = {"error": {"message": NASTY, "code": "bad\x1b[2Jcode"}}
        return web.Response(text=json.dumps(body, ensure_ascii=False), status=400,
                            content_type="application/json")  # the raw bytes, not \u001b

    @route("several-per-chunk")
    async def several(request):  # three tokens in each of two chunks, usage says 6
        resp = await _stream(request)
        await resp.write(_token(" a b c") + _token(" d e f"))
        if request.path.startswith("/several-per-chunk/"):
            await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": 4,
                                                             "completion_tokens": 6}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    routes["several-per-chunk-no-usage"] = several

    @route("eos-first")
    async def eos_first(request):  # the model ended at once: a role chunk, a finish reason
        resp = await _stream(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]}))
        await resp.write(_sse({"choices": [{"index": 0, "delta": {},
                                            "finish_reason": "stop"}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @route("nothing")
    async def nothing(request):  # [DONE] and nothing else: not an answer
        resp = await _stream(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @route("ok")
    async def ok(request):
        resp = await _stream(request)
        await resp.write(_token() + _token() + _sse({"choices": [], "usage": {
            "prompt_tokens": 1, "completion_tokens": 2}}) + b"data: [DONE]\n\n")
        return resp

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": NASTY}]})

    async def endless_models(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"object": "list", "data": [')
        while True:
            await resp.write(b'{"id": "m", "object": "model"}, ' * 2000)

    app = web.Application()
    for name, handler in routes.items():
        app.router.add_post(f"/{name}/v1/chat/completions", handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/endless/v1/models", endless_models)
    app.router.add_post("/v1/chat/completions", routes["ok"])
    return app


async def _run(port: int, route: str, n: int = 3, **cfg_args) -> dict:
    cfg = LoadConfig(target=TargetConfig(base_url=f"http://127.0.0.1:{port}", model="m",
                                         endpoint=f"/{route}/v1/chat/completions"), **cfg_args)
    reqs = random_mm(n, items=0, buckets=parse_buckets(None), prompt_len=2, output_len=2,
                     seed=0, nonce=1)
    records, duration, _ = await run_phase([build_payload(r, cfg, None, {}) for r in reqs], cfg)
    return {"records": records, **compute(records, duration)}


@pytest.mark.parametrize(("route", "kind", "says"), [
    ("long-line", "sse_line_too_long", "an SSE line of more than"),
    ("invalid-json", "invalid_json", '{"choices"'),
    ("string-usage", "invalid_usage", '"completion_tokens": "2"'),
    ("wrong-shape", "invalid_chunk", "choices is a dict"),
    ("bad-extension", "invalid_chunk", '"decode_s": "fast"'),
    ("hang-up", "disconnected", ""),
    ("no-done", "stream_incomplete", "without data: [DONE]"),
    ("error-event", "stream_error:internal_error", "engine died"),
    ("nothing", "no_tokens", "without a content token"),
])
async def test_every_broken_answer_is_a_counted_failure_with_its_type(aiohttp_server, route,
                                                                      kind, says):
    server = await aiohttp_server(hostile_app())
    result = await _run(server.port, route)
    assert result["completed"] == 0 and result["failures_by_type"] == {kind: 3}, result
    assert says in result["failure_examples"][kind]


async def test_an_endless_stream_stops_at_the_size_cap_and_a_stall_at_the_timeout(
        aiohttp_server):
    server = await aiohttp_server(hostile_app())
    result = await _run(server.port, "endless", max_response_bytes=1 << 20)
    assert result["failures_by_type"] == {"response_too_large": 3}
    # nothing of a failed answer is held on to (no text without --tokenizer, no gaps)
    assert all(r.text == [] and len(r.itl) == 0 for r in result["records"])
    # with --tokenizer the text is kept while it streams: bounded too, not the size cap
    # times the concurrency (1.8 GB at 64 clients before)
    result = await _run(server.port, "endless", max_response_bytes=64 << 20, keep_text=True)
    assert result["failures_by_type"] == {"response_too_large": 3}
    assert "--tokenizer" in result["failure_examples"]["response_too_large"]
    assert all(r.text == [] for r in result["records"])
    result = await _run(server.port, "stall", timeout_s=0.5)
    assert result["failures_by_type"] == {"request_timeout": 3}
    assert "--request-timeout" in result["failure_examples"]["request_timeout"]


async def test_an_endless_model_list_is_an_error_not_a_hang(aiohttp_server):
    server = await aiohttp_server(hostile_app())
    root = f"http://127.0.0.1:{server.port}"
    with pytest.raises(ConfigError, match="more than 1048576 bytes"):
        await asyncio.to_thread(first_model, f"{root}/endless", None)
    assert await asyncio.to_thread(first_model, root, None) == (NASTY, None)  # as sent; no root


async def test_what_the_target_says_is_stored_escaped(aiohttp_server):
    server = await aiohttp_server(hostile_app())
    result = await _run(server.port, "nasty-error")
    (kind,) = result["failures_by_type"]
    assert kind == "http_400:bad\\x1b[2Jcode"
    example = result["failure_examples"][kind]
    assert not any(c in example for c in CONTROL)
    assert "\\x1b]0;owned\\x07" in example and "\\u202e" in example and "[/code]" in example


async def test_output_tokens_come_from_usage_else_from_chunks(aiohttp_server):
    """Two chunks of three tokens each: usage says 6 and is believed; without usage the
    count is the chunks' (2), and the result says which it is."""
    server = await aiohttp_server(hostile_app())
    with_usage = await _run(server.port, "several-per-chunk")
    assert with_usage["total_output_tokens"] == 3 * 6
    assert with_usage["output_tokens_from"] == "usage"
    assert all(r.prompt_tokens == 4 for r in with_usage["records"])
    without = await _run(server.port, "several-per-chunk-no-usage")
    assert without["total_output_tokens"] == 3 * 2
    assert without["output_tokens_from"] == "stream chunks"


async def test_an_answer_that_ends_before_its_first_token_is_completed_as_vllm_counts_it(
        aiohttp_server):
    """EOS first (a random model does that): the stream ends with a finish reason and no
    token. vLLM's bench counts it completed with 0 tokens; so does this one, without a TTFT
    sample, and says how many there were."""
    server = await aiohttp_server(hostile_app())
    result = await _run(server.port, "eos-first")
    assert result["completed"] == 3 and result["failed"] == 0, result
    assert result["empty_answers"] == 3 and result["total_output_tokens"] == 0
    assert all(r.ttft is None and r.finish_reason == "stop" for r in result["records"])


def test_escapes():
    assert printable("a\x1b[2Jb\u202ec\nd") == "a\\x1b[2Jb\\u202ec\\x0ad"
    assert printable("x" * 50, 10) == "x" * 10 + " [cut: 50 chars]"
    assert printable(["not", "text"]) == "['not', 'text']"
    assert rich_safe("[/code]") == "\\[/code]"
    assert markdown_safe("a | <b> *c*") == "a \\| \\<b\\> \\*c\\*"


async def _cli(*args: str) -> tuple[int, str, str]:
    """The `aphrodite` command in its own process, while this test's loop serves."""
    exe = Path(sys.executable).with_name("aphrodite")
    proc = await asyncio.create_subprocess_exec(str(exe), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.timeout(240)
async def test_the_command_writes_its_result_and_exits_1_against_a_hostile_target(
        aiohttp_server, tmp_path):
    """Invalid JSON, string usage and a 50 MB line: no traceback, the result file holds the
    failures by type, the exit status is 1; the target's escape sequences and markup reach
    neither the terminal nor summary.md / report.html."""
    server = await aiohttp_server(hostile_app())
    root = f"http://127.0.0.1:{server.port}"
    common = ["bench", "serve", "--num-prompts", "4", "--num-warmups", "0", "--mode", "cold",
              "--items-per-request", "0", "--output-len", "2", "--request-timeout", "20"]
    for route, kind in (("invalid-json", "invalid_json"), ("string-usage", "invalid_usage"),
                        ("long-line", "sse_line_too_long"), ("nasty-error", "http_400")):
        out_dir = tmp_path / route
        code, out, err = await _cli(*common, "--base-url", f"{root}/{route}", "--model", "m",
                                    "--abort-after-failures", "0", "--out-dir", str(out_dir))
        said = out + err
        assert code == 1, said
        assert "Traceback" not in said
        doc = json.loads(next(out_dir.glob("serve-*.json")).read_text())
        assert doc["phases"]["cold"]["failed"] == 4
        assert [k.split(":")[0] for k in doc["phases"]["cold"]["failures_by_type"]] == [kind]
        assert "4 of 4 requests failed" in said
        assert not any(c in said for c in CONTROL), route
    # the refused-at-once path quotes the target too, through rich: [/code] is no markup
    code, out, err = await _cli(*common, "--num-prompts", "6", "--base-url",
                                f"{root}/nasty-error", "--model", "m",
                                "--out-dir", str(tmp_path / "refused"))
    assert code == 1 and "MarkupError" not in err and "[/code]" in err, out + err
    assert not any(c in out + err for c in CONTROL)
    # a model id from GET /v1/models full of escapes and markup: announced escaped, and
    # written escaped into the report's summary.md and report.html
    code, out, err = await _cli(*common, "--base-url", root, "--out-dir", str(tmp_path / "m"))
    assert code == 0, out + err
    assert "model: " in out and not any(c in out + err for c in CONTROL)
    from aphrodite_cli.bench.results.report import write_report

    html_path, md_path = write_report([next((tmp_path / "m").glob("serve-*.json"))],
                                      tmp_path / "report")
    md, page = md_path.read_text(), html_path.read_text()
    assert not any(c in md + page for c in CONTROL)
    assert "<script>alert" not in md + page and "\\| \\*\\*bold" in md
