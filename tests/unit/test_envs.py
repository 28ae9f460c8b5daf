"""One module for APHRODITE_* variables: typed, validated, documented, unknown names warned."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import envs
from engine.config import MediaLimits
from engine.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "docs" / "environment.md"

REQUIRED = ["APHRODITE_IMAGE_FETCH_TIMEOUT", "APHRODITE_VIDEO_FETCH_TIMEOUT",
            "APHRODITE_AUDIO_FETCH_TIMEOUT", "APHRODITE_MEDIA_LOADING_THREAD_COUNT",
            "APHRODITE_VIDEO_LOADER_BACKEND", "APHRODITE_MAX_IMAGE_PIXELS"]


def test_required_variables_and_documented_defaults(monkeypatch):
    for name in REQUIRED:
        monkeypatch.delenv(name, raising=False)
        assert name in envs.DECLARED
    assert envs.APHRODITE_IMAGE_FETCH_TIMEOUT == 10.0
    assert envs.APHRODITE_MEDIA_LOADING_THREAD_COUNT == 8
    assert envs.APHRODITE_VIDEO_LOADER_BACKEND == "opencv"


def test_values_are_parsed_and_flow_into_config(monkeypatch):
    monkeypatch.setenv("APHRODITE_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("APHRODITE_MAX_IMAGE_BYTES", "1234")
    monkeypatch.setenv("APHRODITE_VIDEO_LOADER_BACKEND", "TorchCodec")
    limits = MediaLimits.from_env()
    assert limits.image.fetch_timeout_s == 2.5 and limits.image.max_bytes == 1234
    assert envs.APHRODITE_VIDEO_LOADER_BACKEND == "torchcodec"


@pytest.mark.parametrize("name,value", [
    ("APHRODITE_IMAGE_FETCH_TIMEOUT", "soon"), ("APHRODITE_IMAGE_FETCH_TIMEOUT", "-1"),
    ("APHRODITE_MEDIA_LOADING_THREAD_COUNT", "0"), ("APHRODITE_VIDEO_LOADER_BACKEND", "vlc"),
    ("APHRODITE_DEBUG", "maybe"),
])
def test_bad_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        envs.validate_all()
    assert name in info.value.message and name in info.value.hint


def test_unknown_names_warn_with_a_suggestion():
    with pytest.warns(UserWarning, match="did you mean APHRODITE_IMAGE_FETCH_TIMEOUT"):
        names = envs.warn_unknown({"APHRODITE_IMAGE_FETCH_TIMOUT": "3", "HOME": "/root"})
    assert names == ["APHRODITE_IMAGE_FETCH_TIMOUT"]


def test_no_module_reads_aphrodite_variables_elsewhere():
    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"(environ(\.get)?[\[(]|getenv\()\s*['\"]APHRODITE_")
    offenders = [str(p) for d in ("engine", "aphrodite_cli") for p in (root / d).rglob("*.py")
                 if p.name != "envs.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_readme_documents_every_variable():
    """docs/environment.md's table is what `python -m engine.envs` prints (regenerate it)."""
    text = README.read_text()
    start = text.index("<!-- envs-table:start -->") + len("<!-- envs-table:start -->")
    table = text[start:text.index("<!-- envs-table:end -->")].strip()
    assert table == envs.markdown_table()
    assert all(f"`{name}`" in table for name in envs.DECLARED)


def test_image_background(monkeypatch):
    monkeypatch.setenv("APHRODITE_IMAGE_BACKGROUND", "#000010")
    assert MediaLimits.from_env().image_background == (0, 0, 16)
    monkeypatch.setenv("APHRODITE_IMAGE_BACKGROUND", "300,0,0")
    with pytest.raises(ConfigError):
        MediaLimits.from_env()
