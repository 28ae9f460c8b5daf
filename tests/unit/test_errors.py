"""The error hierarchy: statuses, OpenAI shape, hints, sanitised messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import (
    AphroditeError,
    AuthenticationError,
    ClientError,
    ConfigError,
    EngineError,
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
    internal_error_body,
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


def test_an_error_the_engine_process_reported_keeps_its_status_and_shape():
    body = {"message": "too many items", "type": "invalid_request_error", "param": "messages",
            "code": "too_many_items"}
    err = EngineError(body, 400)
    assert isinstance(err, AphroditeError) and err.status == 400
    assert err.to_openai() == {"error": body}


def test_the_body_of_an_exception_that_is_not_ours_is_written_once():
    """A bug's 500 tells the client nothing of it, in the same words wherever it is caught
    (the API server's middleware, a stream cut after its headers, the engine process)."""
    assert internal_error_body() == {"error": {
        "message": "internal server error", "type": "internal_error", "param": None,
        "code": "internal_error"}}
    engine = Path(__file__).resolve().parents[2] / "engine"
    spelled = {p.name for p in engine.rglob("*.py")
               if '"internal server error"' in p.read_text() or '"internal error"' in
               p.read_text()}
    assert spelled == {"errors.py"}
