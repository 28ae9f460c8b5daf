"""Static URL policy: every rule refuses before any network use, naming rule and flag."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.config import MediaLimits, MediaPolicy
from engine.errors import (
    ClientError,
    ConfigError,
    InvalidRequestError,
    MediaPolicyError,
    MediaTooLargeError,
)
from engine.media.policy import parse_source


@pytest.fixture
def media_dir(tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"x")
    return folder


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://example.com/",
                                 "javascript:alert(1)", "blob:https://x/1", "s3://b/k.png",
                                 "ws://example.com/a"])
def test_other_schemes_refused(url, limits):
    with pytest.raises(MediaPolicyError) as info:
        parse_source(url, "image", MediaPolicy.create(), limits)
    assert info.value.code == "media_scheme_not_allowed"


@pytest.mark.parametrize("url", ["/etc/passwd", "images/a.png", "C:\\a.png", "a.png"])
def test_bare_paths_refused(url, limits, media_dir):
    policy = MediaPolicy.create(allowed_local_path=media_dir)
    with pytest.raises(MediaPolicyError) as info:
        parse_source(url, "image", policy, limits)
    assert info.value.code == "media_bare_path" and "file://" in info.value.hint


def test_file_urls_need_the_flag(limits, media_dir):
    with pytest.raises(MediaPolicyError) as info:
        parse_source(f"file://{media_dir}/a.png", "image", MediaPolicy.create(), limits)
    assert info.value.code == "media_local_path_disabled"
    assert "--allowed-local-media-path" in info.value.hint


def test_file_url_inside_folder_accepted(limits, media_dir):
    policy = MediaPolicy.create(allowed_local_path=media_dir)
    source = parse_source(f"file://{media_dir}/a.png", "image", policy, limits)
    assert source.kind == "file" and source.local_parts == ("a.png",)
    source = parse_source(f"file://localhost{media_dir}/a.png", "image", policy, limits)
    assert source.local_parts == ("a.png",)


@pytest.mark.parametrize("suffix", ["/../secret.png", "/%2e%2e/secret.png", "/sub/../../x.png"])
def test_file_url_escaping_the_folder_refused(limits, media_dir, suffix):
    policy = MediaPolicy.create(allowed_local_path=media_dir)
    with pytest.raises(MediaPolicyError) as info:
        parse_source(f"file://{media_dir}{suffix}", "image", policy, limits)
    assert info.value.code == "media_local_path_outside"


def test_file_url_outside_folder_refused(limits, media_dir, tmp_path):
    policy = MediaPolicy.create(allowed_local_path=media_dir)
    for url in ("file:///etc/passwd", f"file://{tmp_path}/other.png", f"file://{media_dir}",
                f"file://{media_dir}x/a.png"):
        with pytest.raises(MediaPolicyError) as info:
            parse_source(url, "image", policy, limits)
        assert info.value.code == "media_local_path_outside", url


def test_file_url_with_other_host_refused(limits, media_dir):
    policy = MediaPolicy.create(allowed_local_path=media_dir)
    with pytest.raises(MediaPolicyError) as info:
        parse_source(f"file://fileserver{media_dir}/a.png", "image", policy, limits)
    assert info.value.code == "media_local_host"


def test_allowed_local_path_must_be_an_existing_folder(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        MediaPolicy.create(allowed_local_path=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        MediaPolicy.create(allowed_local_path=tmp_path / "file")


@pytest.mark.parametrize("listed,url,allowed", [
    ("media.example.com", "https://media.example.com/a.png", True),
    ("Media.Example.COM.", "https://MEDIA.example.com./a.png", True),
    ("media.example.com", "https://cdn.media.example.com/a.png", False),
    ("media.example.com", "https://media.example.com.evil.net/a.png", False),
    ("example.com", "https://media.example.com/a.png", False),
    ("münchen.de", "https://xn--mnchen-3ya.de/a.png", True),
])
def test_allowed_domains_exact_match(limits, listed, url, allowed):
    policy = MediaPolicy.create(allowed_domains=[listed])
    if allowed:
        assert parse_source(url, "image", policy, limits).kind == "http"
    else:
        with pytest.raises(MediaPolicyError) as info:
            parse_source(url, "image", policy, limits)
        assert info.value.code == "media_domain_not_allowed"
        assert "--allowed-media-domains" in info.value.hint


@pytest.mark.parametrize("url", ["http://user:pw@example.com/a.png",
                                 "http://example.com\\@evil.com/a.png",
                                 "http://exa mple.com/a.png", "http:///a.png",
                                 "http://ex%41mple.com/a.png", "http://a.com/\r\nHost: b"])
def test_malformed_http_urls_refused(limits, url):
    with pytest.raises(ClientError) as info:
        parse_source(url, "image", MediaPolicy.create(), limits)
    assert info.value.status == 400 and info.value.code == "media_malformed_url"


def test_data_url_must_be_base64(limits):
    with pytest.raises(MediaPolicyError) as info:
        parse_source("data:image/png,%89PNG", "image", MediaPolicy.create(), limits)
    assert info.value.code == "media_data_url_not_base64"
    with pytest.raises(InvalidRequestError):
        parse_source("data:image/png;base64", "image", MediaPolicy.create(), limits)


def test_data_url_size_cap_checked_before_decoding(limits):
    from dataclasses import replace

    from engine.config import ModalityLimits

    small = replace(limits, image=ModalityLimits(1000, 1.0))
    # Not even valid base64: the cap must refuse it without trying to decode.
    payload = "!" * 2000
    with pytest.raises(MediaTooLargeError) as info:
        parse_source(f"data:image/png;base64,{payload}", "image", MediaPolicy.create(), small)
    assert info.value.status == 413 and "APHRODITE_MAX_IMAGE_BYTES" in info.value.hint
    ok = base64.b64encode(b"x" * 999).decode()
    assert parse_source(f"data:image/png;base64,{ok}", "image", MediaPolicy.create(),
                        small).kind == "data"


@given(st.text(max_size=60))
def test_parse_source_only_raises_client_errors(text):
    """Whatever a client sends as a URL, the answer is a 4xx or a parsed source."""
    limits = MediaLimits.from_env()
    try:
        parse_source(text, "image", MediaPolicy.create(allowed_domains=["a.com"]), limits)
    except ClientError as err:
        assert 400 <= err.status < 500
