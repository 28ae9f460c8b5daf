"""Tenants: whose cached work a request may share.

Without salting, every cache is shared by everyone who may call the server: the processor
and encoder caches, the prefix cache (a repeat of another client's prompt reports its
``cached_tokens`` and answers sooner) and the media uuids (engine.processing.media_uuids).
A request's *effective salt* keeps tenants apart: vLLM's ``cache_salt`` field, and with
``--cache-salt-per-api-key`` a hash of the API key the request was let in with (so each key's
holders are a tenant of their own without sending anything). Requests of different effective
salts share no cached work; the same one shares all of it.
"""

from __future__ import annotations

import hashlib

#: the request key (aiohttp) under which the auth middleware leaves the key's salt
KEY_SALT = "aphrodite.key_salt"


def key_salt(api_key: str) -> str:
    """The salt of one API key: a hash (the key itself is never kept with a cache entry),
    hex only, so no ``cache_salt`` can end where it begins (see :func:`effective_salt`)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def effective_salt(cache_salt: str | None, salt_of_key: str | None) -> str | None:
    """The salt a request's cached work is keyed by: its ``cache_salt`` under its key's salt
    (None: unsalted, shared with every unsalted request). A key's salt has no ``|``, so
    (key, salt) pairs never collide: ``a|b`` is key ``a`` with salt ``b`` alone."""
    if salt_of_key is None:
        return cache_salt
    return salt_of_key if cache_salt is None else f"{salt_of_key}|{cache_salt}"
