"""Dataset files are hostile input too: media paths stay inside --media-dir, and a file that
is not UTF-8 or a row with a bad field is a one-line error naming the file and row."""

from __future__ import annotations

import base64
import json

import pytest

from aphrodite_cli.bench.load.datasets import load_jsonl
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
