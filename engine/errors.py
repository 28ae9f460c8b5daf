"""One error hierarchy for the whole toolkit.

Every error knows the HTTP status a server answers with, an OpenAI-style ``type``, a stable
``code`` naming the rule that fired, and a one-line ``hint`` naming the flag or setting that
changes the outcome. Catch at the level you need::

    AphroditeError                      any error raised on purpose by this project
    ├── ConfigError                     bad flag, env var or startup setting (CLI exit 2)
    ├── StartupError                    the server cannot start here (a port in use, a process
    │                                   that died while starting; exit 1)
    ├── BenchmarkFailed                 a benchmark's verdict: too many requests failed (exit 1)
    ├── ClientError (4xx)               the request is at fault
    │   ├── InvalidRequestError  400    malformed input
    │   ├── AuthenticationError  401    missing or wrong API key
    │   ├── PermissionDeniedError 403   a request from another site's page (its Origin)
    │   ├── ModelNotFoundError   404    a model name this server does not serve
    │   ├── RouteDisabledError   404    a route this server was started without
    │   ├── RequestTimeoutError  408    the request body did not arrive in time
    │   ├── MediaPolicyError     400    a media URL the operator's policy forbids
    │   ├── MediaFetchError      400    the media could not be fetched (status, timeout, refused)
    │   ├── RequestTooLargeError 413    the request body is over the limit
    │   ├── UnsupportedContentTypeError 415  a POST body that is not JSON
    │   ├── MediaTooLargeError   413    bytes, pixels or duration over a cap
    │   ├── UnsupportedMediaError 400   the bytes are not the kind of media the part says
    │   └── MediaDecodeError     422    the bytes are that kind of media but cannot be decoded
    ├── ServiceUnavailableError (503)   the engine process is not there, or the server is full
    │   └── OverloadedError      503    more sequences in flight than --max-pending-requests
    ├── EngineError                     an error the engine process reported, with its status
    └── InternalError (500)             a bug in this project

Messages never carry tracebacks, memory addresses or paths outside an allowed folder: use
:func:`sanitize` on any text that came from a third-party exception.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar


class AphroditeError(Exception):
    """Base of every error this project raises on purpose."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code or self.default_code
        self.param = param

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ConfigError(AphroditeError):
    """A flag, environment variable or startup setting is invalid."""

    status = 400
    type = "configuration_error"
    default_code = "invalid_configuration"


class StartupError(AphroditeError):
    """The server cannot start for a reason outside its settings: the port is taken, or a
    process of it (the engine, an API server) died or did not become ready while starting."""

    default_code = "startup_failed"


class BenchmarkFailed(AphroditeError):
    """A benchmark run that must not pass: requests failed past ``--max-failure-rate``, or the
    target refused the first requests alike (a wrong URL, model or key)."""

    default_code = "benchmark_failed"


class ClientError(AphroditeError):
    """The request is at fault (a 4xx)."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class InvalidRequestError(ClientError):
    """Malformed input: bad JSON, bad content part, bad base64."""


class AuthenticationError(ClientError):
    """Missing or wrong API key."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(ClientError):
    """The request may not do this from where it comes (another site's page)."""

    status = 403
    type = "permission_error"
    default_code = "forbidden"


class RouteDisabledError(ClientError):
    """A route that is off on this server until a flag turns it on (the cache resets)."""

    status = 404
    type = "not_found_error"
    default_code = "route_disabled"


class ModelNotFoundError(ClientError):
    """A model name this server does not serve."""

    status = 404
    type = "not_found_error"
    default_code = "model_not_found"


class RequestTimeoutError(ClientError):
    """The request body did not arrive within ``--request-body-timeout-s``."""

    status = 408
    default_code = "request_body_timeout"


class UnsupportedContentTypeError(ClientError):
    """A POST whose ``Content-Type`` is not JSON (a browser's cross-site form or text)."""

    status = 415
    default_code = "unsupported_content_type"


class RequestTooLargeError(ClientError):
    """The request body is over ``--max-request-body-mb``."""

    status = 413
    default_code = "request_too_large"


class MediaPolicyError(ClientError):
    """A media reference that the operator's policy forbids; nothing was fetched."""

    default_code = "media_policy_violation"


class MediaFetchError(ClientError):
    """The media could not be fetched: an error status, a timeout, a refused connection."""

    default_code = "media_fetch_failed"


class MediaTooLargeError(ClientError):
    """Bytes, pixels, frames or duration over a configured cap."""

    status = 413
    default_code = "media_too_large"


class UnsupportedMediaError(ClientError):
    """The bytes are not the kind of media the content part claims.

    400, not 415: HTTP's 415 is about the request's own ``Content-Type`` (the front door uses
    it for that), and OpenAI clients raise ``BadRequestError`` only for 400 (415 would surface
    as a bare ``APIStatusError``); vLLM answers media it cannot load with 400 as well. The
    ``code`` still tells this apart from other 400s. Media of the right kind that will not
    decode stays 422 (``UnprocessableEntityError`` in the openai package)."""

    status = 400
    default_code = "unsupported_media_type"


class MediaDecodeError(ClientError):
    """The bytes look like the right kind of media but cannot be decoded."""

    status = 422
    default_code = "media_decode_failed"


class ServiceUnavailableError(AphroditeError):
    """A part of the server (the engine process, a decode worker) is gone or not ready
    (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    default_code = "engine_unavailable"


class OverloadedError(ServiceUnavailableError):
    """Too many requests in flight: answered at once with ``Retry-After``."""

    default_code = "server_overloaded"
    retry_after_s = 1


class EngineError(AphroditeError):
    """An error the engine process reported (over the socket, as an OpenAI error body and a
    status), raised again in the API server with that status and shape."""

    def __init__(self, body: dict[str, Any], status: int) -> None:
        super().__init__(body.get("message", "engine error"), code=body.get("code"),
                         param=body.get("param"))
        self.status = status  # type: ignore[misc]
        self.type = body.get("type", "internal_error")  # type: ignore[misc]


class InternalError(AphroditeError):
    """A bug in this project (HTTP 500)."""


def internal_error_body() -> dict[str, Any]:
    """What a client is told of an exception that is not one of ours (a bug: the details
    are logged, never sent): the OpenAI error body of a 500."""
    return InternalError("internal server error").to_openai()


_ERRNO = re.compile(r"\[Errno -?\d+\]\s*")
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+\b|\b0x[0-9a-fA-F]{6,}\b")
_ABS_PATH = re.compile(r"(?<![\w:/])/(?:[\w.\-+@]+/)*[\w.\-+@]+")


def sanitize(text: object, *, limit: int = 200) -> str:
    """Make third-party error text safe for a client: no addresses, paths or tracebacks.

    Keeps the first line only, replaces memory addresses and absolute paths, and truncates.
    """
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    line = _ERRNO.sub("", line)
    line = _ADDRESS.sub("<addr>", line)
    line = _ABS_PATH.sub("<path>", line)
    return line if len(line) <= limit else line[: limit - 1] + "…"
