"""One streamed request, read defensively: whatever a target sends (a buggy server, a proxy
in between, a hostile endpoint), the answer is a measured request or a counted failure of
that request with a type and an example, never a crash of the benchmark.

Failure types (``RequestRecord.error``; the example, escaped, is ``error_body``):

- ``http_<status>[:<code>]``: a non-200 answer (its body, bounded, is the example);
- ``sse_line_too_long``: one SSE line longer than :data:`MAX_SSE_LINE_BYTES`;
- ``response_too_large``: more than ``--max-response-mb`` in one answer (an endless stream);
- ``request_timeout``: the answer took longer than ``--request-timeout`` (a stall);
- ``invalid_json``: a ``data:`` line that is not JSON;
- ``invalid_chunk``: JSON of the wrong shape (``choices`` not a list, ``content`` not text);
- ``invalid_usage``: ``usage`` counts that are not non-negative integers;
- ``stream_error[:<code>]``: the server sent an error event inside the stream;
- ``stream_incomplete``: the stream ended without ``data: [DONE]``;
- ``disconnected``: the connection broke mid-answer; ``connection_failed``: no connection;
- ``cancelled``: not a failure: the benchmark itself closed the connection
  ``--request-cancellation-delay`` seconds after sending (``RequestRecord.cancelled``);
- ``no_tokens``: a complete stream without a single content token and without a finish
  reason. One that gave a finish reason (the model's end-of-sequence came first) is a
  completed answer with 0 output tokens and no TTFT, as vLLM's ``bench serve`` counts it
  (``empty_answers`` in the result).
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from typing import Any

import aiohttp

from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.results.escape import printable

#: The longest SSE line (one chunk) accepted: a token's chunk is well under a kilobyte, one
#: with top-20 logprobs a few kilobytes; a longer line is a broken or hostile target.
MAX_SSE_LINE_BYTES = 1 << 20
#: The most answer text kept per request for --tokenizer to count (about 250,000 tokens):
#: the text is held until the answer ends, so without this bound an endless stream of long
#: tokens held --max-response-mb of str per request, times the concurrency (1.8 GB at 64)
MAX_KEPT_TEXT_CHARS = 1 << 20
#: How much of a non-200 answer's body is read (its error message)
MAX_ERROR_BODY_BYTES = 1 << 16
#: How long an example kept for a failure type may be, in characters (escaped)
EXAMPLE_CHARS = 300


class ResponseProblem(Exception):
    """What was wrong with an answer: a failure ``kind`` and an ``example`` (escaped)."""

    def __init__(self, kind: str, example: object) -> None:
        super().__init__(kind)
        self.kind, self.example = kind, printable(example, EXAMPLE_CHARS)


#: ``json.loads`` less its per-call checks: a payload that is UTF-8 and one JSON value with
#: nothing after it parses to what ``json.loads`` gives; anything else goes to :func:`_loads`.
_raw_decode = json.JSONDecoder().raw_decode


def _loads(payload: bytes) -> Any:
    """``json.loads``: an SSE payload that is not JSON is the ``invalid_json`` failure."""
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise ResponseProblem("invalid_json", payload[:EXAMPLE_CHARS].decode(
            "utf-8", "replace")) from None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Stream:
    """The parsed stream of one answer, chunk by chunk, into ``record``."""

    def __init__(self, record: RequestRecord, keep_text: bool, any_chunk: bool = False) -> None:
        self.record, self.done, self.keep_text = record, False, keep_text
        self.any_chunk = any_chunk  # --ttft-from chunk: every chunk with choices is a token
        self.last = record.sent_at
        # the gaps as packed doubles while the answer streams: 8 bytes each, not a float
        # object's 32 (a hostile stream of tiny chunks up to the size cap, times the
        # concurrency, is what the client holds)
        self.itl = array("d")
        self.kept = 0  # characters of text kept (keep_text)

    def line(self, raw: bytes) -> None:
        if not raw.startswith(b"data:"):
            return  # blank separators, comments (":"), event:/id:/retry: fields
        payload = raw[5:].strip()  # a CRLF line's \r too
        if payload == b"[DONE]":
            self.done = True
            return
        try:  # the common case in one C call: UTF-8 text that is one JSON value
            text = payload.decode()
            chunk, end = _raw_decode(text)
            if end != len(text):
                raise ValueError("extra data")
        except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
            chunk = _loads(payload)  # json.loads's own rules decide (UTF-16, a BOM)
        if not isinstance(chunk, dict):
            raise ResponseProblem("invalid_chunk", f"a chunk that is a {type(chunk).__name__}: "
                                  f"{payload[:200].decode('utf-8', 'replace')}")
        if "error" in chunk:
            err = chunk["error"]
            code = err.get("code") if isinstance(err, dict) else None
            message = err.get("message") if isinstance(err, dict) else err
            raise ResponseProblem("stream_error" + (f":{printable(code, 60)}" if code else ""),
                                  message)
        self.chunk(chunk, payload)

    def chunk(self, chunk: dict[str, Any], payload: bytes) -> None:
        record = self.record
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise ResponseProblem("invalid_chunk", f"choices is a {type(choices).__name__}")
        if choices:
            choice = choices[0]
            if not isinstance(choice, dict):
                raise ResponseProblem("invalid_chunk", f"a choice is a {type(choice).__name__}")
            delta = choice.get("delta")
            if delta is None:
                piece = choice.get("text")
            elif isinstance(delta, dict):
                piece = delta.get("content") or choice.get("text")
            else:
                raise ResponseProblem("invalid_chunk", f"delta is a {type(delta).__name__}")
            if piece is not None and not isinstance(piece, str):
                raise ResponseProblem("invalid_chunk", "the content is a "
                                      f"{type(piece).__name__}, not text: "
                                      f"{payload[:200].decode('utf-8', 'replace')}")
            reason = choice.get("finish_reason")
            if reason and isinstance(reason, str):
                record.finish_reason = reason[:40]
            # A chunk with no text (the role chunk many servers send first, an empty delta)
            # is not a token: it starts no TTFT and adds no ITL sample; with --ttft-from
            # chunk it is (vLLM's bench serve's rule).
            if piece or self.any_chunk:
                if self.keep_text and piece:  # --tokenizer and a session's next turn read it
                    self.kept += len(piece)
                    if self.kept > MAX_KEPT_TEXT_CHARS:
                        raise ResponseProblem(
                            "response_too_large", f"more than {MAX_KEPT_TEXT_CHARS} "
                            "characters of answer text, kept to count its tokens "
                            "(--tokenizer) or to resend in a session's next turn "
                            f"(--conversation-num); it began: {''.join(record.text)[:120]}")
                    record.text.append(piece)
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - record.sent_at
                else:
                    self.itl.append(now - self.last)
                self.last = now
                record.output_tokens += 1
        usage = chunk.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise ResponseProblem("invalid_usage", f"usage is a {type(usage).__name__}")
        if usage and "completion_tokens" in usage:
            completion, prompt = usage["completion_tokens"], usage.get("prompt_tokens", 0)
            if not _count(completion) or not _count(prompt):
                raise ResponseProblem("invalid_usage", "usage counts are not non-negative "
                                      f"integers: {json.dumps(usage)[:200]}")
            record.output_tokens, record.prompt_tokens = completion, prompt
            # of them, what the target's prefix cache supplied (OpenAI's and vLLM's field)
            details = usage.get("prompt_tokens_details")
            cached = (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
            if not _count(cached):
                raise ResponseProblem("invalid_usage", "usage counts are not non-negative "
                                      f"integers: {json.dumps(usage)[:200]}")
            record.cached_tokens = cached
            record.token_source = "usage"
            details = usage.get("prompt_tokens_details")  # cached / image / audio tokens
            record.prompt_details = details if isinstance(details, dict) else None
        if "aphrodite" in chunk:  # this project's extension: stage timings, cache hits
            record.server = _extension(chunk["aphrodite"])


def _extension(ext: object) -> dict[str, Any]:
    """The ``aphrodite`` extension, checked: timings a dict of numbers, cache hits a list."""
    timings = ext.get("timings", {}) if isinstance(ext, dict) else None
    hits = ext.get("cache_hits", []) if isinstance(ext, dict) else None
    if not isinstance(timings, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in timings.values()) \
            or not isinstance(hits, list):
        raise ResponseProblem("invalid_chunk", "the aphrodite extension is not timings (a "
                              "dict of numbers) and cache_hits (a list): "
                              f"{json.dumps(ext)[:200]}")
    return ext


async def _error_answer(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
    body = b""
    while len(body) < MAX_ERROR_BODY_BYTES and (piece := await resp.content.read(65536)):
        body += piece  # the whole error body (bounded), however it arrives
    text = body[:MAX_ERROR_BODY_BYTES].decode("utf-8", "replace")
    try:
        error = json.loads(text).get("error")
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        code = message = None
    record.error = f"http_{resp.status}" + (f":{printable(code, 60)}" if code else "")
    # the OpenAI error shape's message, decoded (its \u001b is an escape too), else the body
    record.error_body = printable(message if isinstance(message, str) else text, 500)


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord,
                       max_bytes: int, keep_text: bool, any_chunk: bool = False) -> None:
    stream = _Stream(record, keep_text, any_chunk)
    pending = bytearray()
    total = 0
    async for piece in resp.content.iter_any():
        total += len(piece)
        if total > max_bytes:
            raise ResponseProblem("response_too_large", f"more than {max_bytes} bytes "
                                  "(--max-response-mb) in one answer; it began: "
                                  f"{bytes(pending[:120]).decode('utf-8', 'replace')}")
        pending += piece
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            if pending.startswith(b"data:", start, end):  # else nothing to read in it
                stream.line(bytes(pending[start:end]))
            start = end + 1
            if stream.done:
                record.itl = stream.itl.tolist()
                return
        del pending[:start]
        if len(pending) > MAX_SSE_LINE_BYTES:
            raise ResponseProblem("sse_line_too_long", f"an SSE line of more than "
                                  f"{MAX_SSE_LINE_BYTES} bytes; it began: "
                                  f"{bytes(pending[:120]).decode('utf-8', 'replace')}")
    if pending:
        stream.line(bytes(pending))
    if not stream.done:
        raise ResponseProblem("stream_incomplete", f"the stream ended after {total} bytes "
                              "without data: [DONE]")
    record.itl = stream.itl.tolist()


async def one_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      body: bytes, record: RequestRecord, *, timeout_s: float = 300.0,
                      max_bytes: int = 16 << 20, keep_text: bool = False,
                      any_chunk: bool = False, cancel_after: float | None = None) -> None:
    """Send ``body`` and read the streamed answer into ``record``: timed (TTFT, ITL, E2E)
    when it is sound, else failed with a type and an escaped example. At most ``timeout_s``
    seconds and ``max_bytes`` bytes of answer; the answer's text is kept only with
    ``keep_text`` (for counting its tokens), and nothing of a failed answer's.
    ``any_chunk``: every chunk with choices is a token, text or not (``--ttft-from chunk``).
    ``cancel_after``: close the connection this many seconds after sending, wherever the
    answer is then (waiting for headers, mid-stream): the record is ``cancelled``, not failed;
    an answer complete before then is a completed request."""
    record.request_bytes = len(body)
    record.sent_at = time.perf_counter()
    cut = asyncio.timeout(cancel_after)  # None: never
    try:
        async with asyncio.timeout(timeout_s), cut, session.post(url, data=body,
                                                                 headers=headers) as resp:
            record.status = resp.status
            try:
                if resp.status != 200:
                    await _error_answer(resp, record)
                    return
                await _read_stream(resp, record, max_bytes, keep_text, any_chunk)
            except asyncio.CancelledError:
                resp.close()  # the connection, mid-answer: the server sees the client leave
                raise
        record.e2e = time.perf_counter() - record.sent_at
        record.ok = record.ttft is not None or record.finish_reason is not None
        if not record.ok:
            record.error = "no_tokens"
            record.error_body = "a complete stream without a content token"
    except ResponseProblem as problem:
        record.error, record.error_body = problem.kind, problem.example
    except TimeoutError:
        if cut.expired():  # ours, not the target's: counted apart from failures
            record.cancelled, record.error = True, "cancelled"
            record.error_body = (f"closed by the benchmark {cancel_after:g} s after sending "
                                 f"(--request-cancellation-delay); {record.output_tokens} "
                                 "tokens had arrived")
        else:
            record.error = "request_timeout"
            record.error_body = (f"no complete answer within {timeout_s:g} s "
                                 f"(--request-timeout); {record.output_tokens} tokens had "
                                 "arrived")
    except aiohttp.ClientConnectorError as exc:
        record.error, record.error_body = "connection_failed", printable(exc, EXAMPLE_CHARS)
    except (aiohttp.ClientError, ConnectionError) as exc:
        # payload errors, a server that hung up, malformed HTTP (aiohttp wraps its parser's
        # errors, a header line too long included, in ClientResponseError)
        record.error = "disconnected" if isinstance(exc, aiohttp.ServerDisconnectedError
                                                    | aiohttp.ClientPayloadError
                                                    | ConnectionError) else "bad_http"
        record.error_body = printable(f"{type(exc).__name__}: {exc}", EXAMPLE_CHARS)
    finally:
        if not record.ok:  # a failed answer's gaps and text are never read: let them go
            record.itl, record.text = [], []
