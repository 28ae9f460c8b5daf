"""The error hierarchy: statuses, OpenAI shape, hints, sanitised messages."""

from __future__ import annotations

import pytest

from engine.errors import (
    AphroditeError,
    AuthenticationError,
    ClientError,
    ConfigError,
    InternalError,
    InvalidRequestError,
    MediaDecodeError,
    MediaFetchError,
    MediaPolicyError,
    MediaTooLargeError,
    ModelNotFoundError,
    RequestTooLargeError,
    ServiceUnavailableError,
    UnsupportedMediaError,
    sanitize,
)


@pytest.mark.parametrize("cls,status", [
    (InvalidRequestError, 400), (MediaPolicyError, 400), (MediaFetchError, 400),
    (MediaTooLargeError, 413), (UnsupportedMediaError, 400), (MediaDecodeError, 422),
    (InternalError, 500), (AuthenticationError, 401), (ModelNotFoundError, 404),
    (RequestTooLargeError, 413), (ServiceUnavailableError, 503),
])
def test_statuses(cls, status):
    assert cls.status == status
    assert issubclass(cls, AphroditeError)
    assert issubclass(cls, ClientError) == (status < 500)
    assert cls("x").to_openai()["error"]["type"]


def test_openai_shape_includes_the_hint():
    err = MediaPolicyError("media host 'x' is refused", hint="add x to --allowed-media-domains",
                           code="media_domain_not_allowed", param="messages")
    body = err.to_openai()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "media_domain_not_allowed"
    assert "--allowed-media-domains" in body["error"]["message"]


def test_config_error_is_not_a_client_error():
    assert not issubclass(ConfigError, ClientError)


def test_sanitize_strips_addresses_paths_and_tracebacks():
    text = ("cannot identify image file <_io.BytesIO object at 0x7f3a2b1c9e50> in "
            "/usr/lib/python3/site.py\nTraceback (most recent call last):")
    clean = sanitize(text)
    assert "0x7f" not in clean and "/usr/lib" not in clean and "Traceback" not in clean
    assert "cannot identify image file" in clean
    assert len(sanitize("x" * 1000)) <= 200
