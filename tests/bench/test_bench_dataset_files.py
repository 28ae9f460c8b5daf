"""Dataset files are hostile input too: media paths stay inside --media-dir, and a file that
is not UTF-8 or a row with a bad field is a one-line error naming the file and row."""

from __future__ import annotations

import base64
import json

import pytest

from aphrodite_cli.bench.data.datasets import load_jsonl
from aphrodite_cli.bench.load.trace import load_trace
from engine.errors import ConfigError


@pytest.fixture
def media(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "cat.jpg").write_bytes(b"\xff\xd8cat")
    (tmp_path / "secret.txt").write_text("do not upload")
    (inside / "link.jpg").symlink_to(tmp_path / "secret.txt")
    return inside


def jsonl_row(path: str, **extra) -> str:
    return json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"path": path}}]}], **extra})


def trace_line(path: str) -> str:
    return json.dumps({"arrival_s": 0, "prompt": "x", "media": [{"type": "image",
                                                                  "path": path}]})


@pytest.mark.parametrize("make", [jsonl_row, trace_line])
def test_a_media_path_inside_media_dir_is_sent_inline(tmp_path, media, make):
    data = tmp_path / "rows.jsonl"
    data.write_text(make("cat.jpg") + "\n")
    rows = (load_jsonl(data, media) if make is jsonl_row
            else load_trace(data, media, limit=10, nonce=0))
    assert base64.b64encode(b"\xff\xd8cat").decode() in json.dumps(rows[0].messages)


@pytest.mark.parametrize("make", [jsonl_row, trace_line])
@pytest.mark.parametrize("path", ["../secret.txt", "{root}/secret.txt", "link.jpg",
                                  "sub/../../secret.txt"])
def test_a_media_path_that_leaves_media_dir_is_refused(tmp_path, media, make, path):
    data = tmp_path / "rows.jsonl"
    data.write_text(make(path.format(root=tmp_path)) + "\n")
    with pytest.raises(ConfigError, match="outside --media-dir") as info:
        load_jsonl(data, media) if make is jsonl_row else load_trace(data, media, limit=10,
                                                                     nonce=0)
    assert f"{data}:1" in str(info.value)


@pytest.mark.parametrize(("line", "says"), [
    (jsonl_row("missing.jpg"), "is not a file"),
    (jsonl_row("cat.jpg", output_len=True), "output_len"),
    (jsonl_row("cat.jpg", output_len="16"), "output_len"),
    (jsonl_row("cat.jpg", output_len=10 ** 30), "output_len"),
    (json.dumps({"messages": "hi"}), "messages is a list of objects"),
    (json.dumps({"messages": [{"role": "user", "content": ["text"]}]}), None),
])
def test_bad_rows_are_one_line_errors_naming_the_row(tmp_path, media, line, says):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n" + line + "\n")
    if says is None:  # a content part that is not an object is sent as it is (the server's)
        assert load_jsonl(data, media)[0].messages[0]["content"] == ["text"]
        return
    with pytest.raises(ConfigError, match=says) as info:
        load_jsonl(data, media)
    assert f"{data}:2" in str(info.value)


@pytest.mark.parametrize("load", [lambda p, m: load_jsonl(p, m),
                                  lambda p, m: load_trace(p, m, limit=1, nonce=0)])
def test_a_file_that_is_not_utf8_is_named(tmp_path, media, load):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(data, media)


def trace_row(**fields) -> str:
    return json.dumps({"arrival_s": 0, "prompt": "x", **fields}, allow_nan=True)


@pytest.mark.parametrize(("line", "says"), [
    (trace_row(arrival_s=float("nan")), "arrival_s is a finite number"),
    (trace_row(arrival_s=float("inf")), "arrival_s is a finite number"),
    (trace_row(arrival_s=-1), "arrival_s is a finite number"),
    (trace_row(arrival_s=True), "arrival_s is a finite number"),
    (trace_row(arrival_s="5"), "arrival_s is a finite number"),
    ('{"timestamp": NaN, "prompt": "x"}', "timestamp is a finite number"),
    (trace_row(output_len=True), "output_len is a whole number"),
    (trace_row(output_len=2.5), "output_len is a whole number"),
    (trace_row(output_len=10 ** 30), "output_len is a whole number"),
    (trace_row(output_length=-3), "output_length is a whole number"),
    (trace_row(prompt={"a": 1}), "prompt is a string"),
    (trace_row(kind=[1]), "kind is a string"),
    (trace_row(media="cat.jpg"), "media is a list"),
    (trace_row(media=[{"type": "image", "width": True, "height": 8}]), "width is a whole"),
    (trace_row(media=[{"type": "image", "width": 10 ** 6, "height": 8}]), "width is a whole"),
    (trace_row(media=[{"type": "video", "width": 4000, "height": 4000, "frames": 3000}]),
     "past the cap"),
    (trace_row(media=[{"type": "image", "url": 7}]), "url is a string"),
    ("[" * 100_000, "is not JSON"),
    ("[1]", "is not a JSON object"),
])
def test_bad_trace_lines_are_one_line_errors_naming_the_line_and_field(tmp_path, media, line,
                                                                       says):
    data = tmp_path / "trace.jsonl"
    data.write_text(trace_row() + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=says) as info:
        load_trace(data, media, limit=10, nonce=0)
    assert f"{data}:2" in info.value.message and "\n" not in info.value.message


def test_a_trace_that_would_never_end_is_refused(tmp_path, media):
    """An arrival 10^11 s after the first (finite, but a run that never ends) is named."""
    data = tmp_path / "trace.jsonl"
    data.write_text(trace_row() + "\n" + trace_row(arrival_s=1e11) + "\n")
    with pytest.raises(ConfigError, match="past the cap of 604800 s"):
        load_trace(data, media, limit=10, nonce=0)


def test_a_jsonl_row_nested_past_the_parser_is_named(tmp_path, media):
    data = tmp_path / "rows.jsonl"
    data.write_text("[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=f"{data}:1 is not a JSON object"):
        load_jsonl(data, media)
