"""Decoding of base64 ``data:`` URLs (the size cap was checked by the policy)."""

from __future__ import annotations

import base64
import binascii

from engine.errors import InvalidRequestError


def decode_base64_payload(payload: str) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, padding optional); raises on bad input."""
    text = payload.strip()
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            "the data URL's base64 payload is malformed",
            hint="encode the media with standard base64 (RFC 4648)",
            code="media_data_url_malformed",
        ) from None
