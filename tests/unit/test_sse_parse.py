"""The SSE reader's payload parse (load/sse_client.py): its one-call path for UTF-8 JSON gives
exactly what ``json.loads`` gives, and whatever ``json.loads`` refuses is still the
``invalid_json`` failure, for any bytes a target sends after ``data:``."""

from __future__ import annotations

import json

from hypothesis import example, given
from hypothesis import strategies as st

from aphrodite_cli.bench.load import sse_client
from aphrodite_cli.bench.load.metrics import RequestRecord

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


def _reference(payload: bytes) -> tuple[str, object]:
    """The rule before the fast path: ``json.loads`` of the stripped payload."""
    try:
        return "ok", json.loads(payload.strip())
    except (ValueError, UnicodeDecodeError):
        return "invalid_json", None


def _parsed(payload: bytes) -> tuple[str, object]:
    seen = []
    stream = sse_client._Stream(RequestRecord(0), keep_text=False)
    stream.chunk = lambda chunk, raw: seen.append(chunk)  # what the line parsed to
    try:
        stream.line(b"data:" + payload)
    except sse_client.ResponseProblem as problem:
        if problem.kind != "invalid_json":  # parsed: not an object, or an error event
            return "ok", json.loads(payload.strip())
        return problem.kind, None
    return ("done", None) if stream.done else ("ok", seen[0])


@given(st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    JSON.map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
    JSON.map(lambda v: json.dumps(v).encode("utf-16")),
    st.tuples(JSON, st.binary(max_size=6)).map(lambda t: json.dumps(t[0]).encode() + t[1]),
    st.tuples(st.binary(max_size=6), JSON).map(lambda t: t[0] + json.dumps(t[1]).encode()),
    st.binary(max_size=40)))
@example(b' {"a": 1}\r')
@example(b'\xef\xbb\xbf{"a": 1}')  # a UTF-8 byte order mark: json.loads takes it
@example(b'{"a": 1}\x0c')
@example(b'{"a": 1} {"b": 2}')
@example(b"")
@example(b"[DONE]")
def test_the_fast_parse_is_json_loads(payload):
    expected = _reference(payload)
    if payload.strip() == b"[DONE]":
        expected = ("done", None)
    got = _parsed(payload)
    assert got[0] == expected[0], (payload, got, expected)
    if got[0] == "ok":
        assert json.dumps(got[1], sort_keys=True) == json.dumps(expected[1], sort_keys=True)
