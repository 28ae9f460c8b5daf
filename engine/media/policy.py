"""Parse a media reference and apply the operator's policy, before any byte is fetched.

Rules, each with the ``code`` its refusal carries:

- ``media_scheme_not_allowed``: only ``http``, ``https``, ``data`` and ``file`` URLs.
- ``media_bare_path``: a path is not a URL; use ``file://`` with ``--allowed-local-media-path``.
- ``media_malformed_url``: no host, credentials, bad characters in the host.
- ``media_domain_not_allowed``: ``--allowed-media-domains`` is set and the host is not on it.
- ``media_private_address``: the host is (or resolves to) a non-public address, or, for a
  name that is not listed, does not resolve at all (one answer for both, so no client can
  map internal names); checked when the host is resolved (see :mod:`engine.media.addresses`).
- ``media_data_url_not_base64`` / ``media_data_url_malformed``: data URLs must be base64.
- ``media_local_path_disabled`` / ``media_local_host`` / ``media_local_path_outside``: the
  ``file://`` rules.
- ``media_too_large``: a data URL whose decoded size is over the modality's byte cap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

from yarl import URL

from engine.config import MediaLimits, MediaPolicy, Modality, normalize_host
from engine.errors import InvalidRequestError, MediaPolicyError, MediaTooLargeError

SourceKind = Literal["http", "data", "file"]

_HOST_CHARS = re.compile(r"^[a-z0-9.\-_:]+$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


@dataclass(frozen=True)
class MediaSource:
    """A media reference that passed the static policy checks."""

    kind: SourceKind
    modality: Modality
    display: str
    http_url: URL | None = None
    host: str | None = None
    data_mime: str | None = None
    data_payload: str | None = None
    local_parts: tuple[str, ...] | None = None


def display_url(url: str, limit: int = 80) -> str:
    """A short, log-safe form of a URL (data URLs are never echoed whole)."""
    if url[:5].lower() == "data:":
        head = url.split(",", 1)[0]
        return f"{head[:60]},<{max(len(url) - len(head) - 1, 0)} chars>"
    return url if len(url) <= limit else url[: limit - 1] + "…"


def parse_source(
    url: str, modality: Modality, policy: MediaPolicy, limits: MediaLimits
) -> MediaSource:
    """Classify ``url`` and apply every rule that needs no network; raise on refusal."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequestError(f"the {modality} URL is empty", code="media_malformed_url")
    url = url.strip()
    match = _SCHEME.match(url)
    if match is None or len(match.group(1)) == 1:  # "C:\..." is a Windows path, not a scheme
        raise MediaPolicyError(
            f"{display_url(url)!r} is a bare path, not a URL",
            hint="use a file:// URL inside the folder given by --allowed-local-media-path",
            code="media_bare_path",
        )
    scheme = match.group(1).lower()
    if scheme in ("http", "https"):
        return _parse_http(url, modality, policy)
    if scheme == "data":
        return _parse_data(url, modality, limits)
    if scheme == "file":
        return _parse_file(url, modality, policy)
    raise MediaPolicyError(
        f"URL scheme {scheme!r} is not allowed for media",
        hint="use http(s)://, data: (base64) or file:// with --allowed-local-media-path",
        code="media_scheme_not_allowed",
    )


def check_http_url(url: URL, policy: MediaPolicy) -> URL:
    """``url`` with its host normalized, after the host and domain rules (redirects too).

    The host checked and the host fetched are one string: ``127.0.0.1.``, ``127.0.0.1。``
    (an ideographic full stop, which IDNA maps to ``.``) and ``MEDIA.example.`` are checked
    *and* connected to as ``127.0.0.1`` and ``media.example``, so no spelling can make the
    policy and the URL library (or the resolver) disagree on which host is meant.
    """
    shown = display_url(str(url))
    if url.scheme not in ("http", "https"):
        raise MediaPolicyError(
            f"media URL {shown!r} uses scheme {url.scheme!r}; only http and https are fetched",
            hint="media redirects may only go to http(s) URLs",
            code="media_scheme_not_allowed",
        )
    if not url.raw_host:
        raise InvalidRequestError(f"media URL {shown!r} has no host", code="media_malformed_url")
    if url.raw_user is not None or url.raw_password is not None:
        raise MediaPolicyError(
            f"media URL {shown!r} carries credentials, which are refused",
            hint="serve the media without user:password@ in the URL",
            code="media_malformed_url",
        )
    host = normalize_host(url.raw_host)
    if not _HOST_CHARS.match(host):
        raise InvalidRequestError(
            f"media URL {shown!r} has invalid characters in its host", code="media_malformed_url"
        )
    if policy.allowed_domains and host not in policy.allowed_domains:
        raise MediaPolicyError(
            f"media host {host!r} is not in the allowed media domains",
            hint=f"add {host} to --allowed-media-domains to allow it",
            code="media_domain_not_allowed",
        )
    if url.raw_host == host:
        return url
    try:
        return url.with_host(host)
    except ValueError as exc:
        raise InvalidRequestError(
            f"media URL {shown!r} has an invalid host", code="media_malformed_url"
        ) from exc


def _parse_http(url: str, modality: Modality, policy: MediaPolicy) -> MediaSource:
    if any(ch in url for ch in "\\\r\n\t ") or any(ord(ch) < 0x20 for ch in url):
        raise InvalidRequestError(
            f"media URL {display_url(url)!r} contains whitespace, control characters or '\\'",
            code="media_malformed_url",
        )
    canonical = check_http_url(parse_http_url(url), policy)
    return MediaSource("http", modality, display_url(url), http_url=canonical,
                       host=canonical.raw_host)


def parse_http_url(url: str) -> URL:
    """``url`` parsed by the URL library the fetch uses; anything it cannot parse is a 400.

    yarl raises more than ``ValueError`` on some inputs (``http://[]@/x`` is an
    ``IndexError``), so every exception from the parse is the client's malformed URL.
    """
    try:
        return URL(url, encoded=False)
    except Exception as exc:
        raise InvalidRequestError(
            f"media URL {display_url(url)!r} is malformed", code="media_malformed_url"
        ) from exc


def _parse_data(url: str, modality: Modality, limits: MediaLimits) -> MediaSource:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidRequestError(
            "data URL has no ',' separating its header from its data",
            code="media_data_url_malformed",
        )
    params = [p.strip() for p in header.split(";")]
    if "base64" not in (p.lower() for p in params[1:]):
        raise MediaPolicyError(
            "only base64 data URLs are accepted for media",
            hint="encode the media as data:<mime>;base64,<data>",
            code="media_data_url_not_base64",
        )
    mime = params[0].lower() or None
    cap = limits.for_modality(modality).max_bytes
    stripped = payload.rstrip("=")
    decoded_size = len(stripped) * 3 // 4
    if decoded_size > cap:
        raise MediaTooLargeError(
            f"{modality} data URL holds about {decoded_size} bytes, over the {cap}-byte cap",
            hint=f"send a smaller {modality} or raise APHRODITE_MAX_{modality.upper()}_BYTES",
        )
    return MediaSource(
        "data", modality, display_url(url), data_mime=mime, data_payload=payload
    )


def _parse_file(url: str, modality: Modality, policy: MediaPolicy) -> MediaSource:
    shown = display_url(url)
    if policy.allowed_local_path is None:
        raise MediaPolicyError(
            "local file media is disabled",
            hint="start with --allowed-local-media-path DIR to serve files from DIR",
            code="media_local_path_disabled",
        )
    rest = url[len("file:"):]
    if not rest.startswith("//"):
        raise MediaPolicyError(
            f"{shown!r} is not a file:///absolute/path URL",
            hint="write local media as file:///absolute/path inside --allowed-local-media-path",
            code="media_malformed_url",
        )
    authority, _, path = rest[2:].partition("/")
    if authority.lower() not in ("", "localhost"):
        raise MediaPolicyError(
            f"file URL {shown!r} names host {authority!r}; only local files are read",
            hint="use file:///path (no host) inside --allowed-local-media-path",
            code="media_local_host",
        )
    path = "/" + unquote(path.split("?", 1)[0].split("#", 1)[0])
    if "\x00" in path:
        raise InvalidRequestError("file URL contains a NUL byte", code="media_malformed_url")
    root_parts = policy.allowed_local_path.parts  # type: ignore[union-attr]
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts or parts[: len(root_parts) - 1] != root_parts[1:] or (
        len(parts) <= len(root_parts) - 1
    ):
        raise MediaPolicyError(
            "local media must be a file inside the allowed local media folder",
            hint="move the file under --allowed-local-media-path or point the flag at its folder",
            code="media_local_path_outside",
        )
    return MediaSource(
        "file", modality, shown, local_parts=parts[len(root_parts) - 1:]
    )
