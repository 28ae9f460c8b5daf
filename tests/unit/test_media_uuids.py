"""Media uuids and tenants without a model (milliseconds): a content part's ``uuid`` as the
chat parser reads it, the per-tenant store a uuid-only part is rebuilt from, the effective
salt of a request, and the API key check with several keys."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError, InvalidRequestError
from engine.processing.chat_parts import MAX_UUID_CHARS, parse_messages
from engine.processing.media_uuids import MediaUuids
from engine.processing.preprocess import MediaItem
from engine.server.api.front_door import matching_key
from engine.server.api.tenants import effective_salt, key_salt
from engine.server.config import ServerConfig


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]


def test_a_part_with_media_and_uuid_and_one_with_the_uuid_alone():
    parsed = parse_messages(user(
        {"type": "image_url", "image_url": {"url": "http://h/a.jpg"}, "uuid": "sku-1"},
        {"type": "image_url", "image_url": None, "uuid": "sku-1"},
        {"type": "input_audio", "uuid": "clip-9"},
        {"type": "video_url", "video_url": {"url": "http://h/v.mp4"}}))
    assert [(r.modality, r.url, r.uuid) for r in parsed.refs] == [
        ("image", "http://h/a.jpg", "sku-1"), ("image", None, "sku-1"),
        ("audio", None, "clip-9"), ("video", "http://h/v.mp4", None)]
    assert parsed.media == [("image", "http://h/a.jpg"), ("video", "http://h/v.mp4")]
    assert parsed.counts() == {"image": 2, "audio": 1, "video": 1}  # the limits count all
    assert [p["type"] for p in parsed.messages[0]["content"]] == [
        "image", "image", "audio", "video", "text"]


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "image_url", "image_url": None}, "messages", "neither its media nor a uuid"),
    ({"type": "video_url"}, "messages", "neither its media nor a uuid"),
    ({"type": "image_url", "image_url": None, "uuid": ""}, "messages[0].content[0].uuid",
     "non-empty string"),
    ({"type": "image_url", "image_url": None, "uuid": 7}, "messages[0].content[0].uuid",
     "non-empty string"),
    ({"type": "image_url", "image_url": {"url": "http://h/a"}, "uuid": ["x"]},
     "messages[0].content[0].uuid", "non-empty string"),
    ({"type": "image_url", "image_url": None, "uuid": "u" * (MAX_UUID_CHARS + 1)},
     "messages[0].content[0].uuid", f"at most {MAX_UUID_CHARS}"),
])
def test_bad_uuid_parts_are_a_400_naming_the_part(part, param, words):
    with pytest.raises(InvalidRequestError) as info:
        parse_messages(user(part))
    assert info.value.param == param and words in info.value.message


def refs(*parts: dict):
    return parse_messages(user(*parts)).refs


WITH = {"type": "image_url", "image_url": {"url": "data:,a"}, "uuid": "sku-1"}
ALONE = {"type": "image_url", "image_url": None, "uuid": "sku-1"}


def test_a_uuid_names_the_last_content_sent_under_it_per_tenant():
    store = MediaUuids(1 << 20)
    store.remember(refs(WITH), [MediaItem("image", encoded=b"first")], "tenant-a")
    assert store.held(refs(ALONE), "tenant-a") == [("image", b"first")]
    # the same uuid with other content re-points it (caches stay keyed by content)
    store.remember(refs(WITH), [MediaItem("image", encoded=b"second")], "tenant-a")
    assert store.held(refs(ALONE), "tenant-a") == [("image", b"second")]
    assert store.held(refs(WITH), "tenant-a") == [None]  # (a part with media needs none)
    # another tenant, or none, cannot name tenant-a's uuid
    for tenant in ("tenant-b", None, effective_salt("tenant-a", key_salt("k"))):
        with pytest.raises(InvalidRequestError) as info:
            store.held(refs(ALONE), tenant)
        assert info.value.code == "unknown_media_uuid"
        assert info.value.param == "messages[0].content[0].uuid"
        assert "'sku-1'" in info.value.message and "evicted" in info.value.message


def test_a_uuid_names_one_modality_and_the_store_is_bounded():
    store = MediaUuids(10)
    store.remember(refs(WITH), [MediaItem("image", encoded=b"12345678")], None)
    with pytest.raises(InvalidRequestError, match="names image media, not video"):
        store.held(refs({"type": "video_url", "video_url": None, "uuid": "sku-1"}), None)
    other = {**WITH, "uuid": "sku-2"}
    store.remember(refs(other), [MediaItem("image", encoded=b"87654321")], None)
    with pytest.raises(InvalidRequestError, match="--mm-uuid-cache-gb"):  # evicted: LRU
        store.held(refs(ALONE), None)
    assert store.held(refs({**ALONE, "uuid": "sku-2"}), None) == [("image", b"87654321")]
    with pytest.raises(InvalidRequestError, match=r"--mm-uuid-cache-gb 0"):
        MediaUuids(0).held(refs(ALONE), None)


def test_the_effective_salt_keeps_keys_and_salts_apart():
    a, b = key_salt("key-a"), key_salt("key-b")
    assert a != b and "key-a" not in a and "|" not in a
    assert effective_salt(None, None) is None and effective_salt("s", None) == "s"
    salts = {effective_salt(s, k) for s in (None, "s", "t") for k in (None, a, b)}
    assert len(salts) == 9  # every (cache_salt, key) pair its own tenant
    # under a key, no cache_salt reaches another key's tenant
    assert effective_salt(b.removeprefix("key:"), a) != effective_salt(None, b)


def test_several_api_keys_and_the_salt_per_key_on_the_request():
    assert matching_key("Bearer two", ("one", "two")) == "two"
    assert matching_key("Bearer three", ("one", "two")) is None
    assert matching_key(None, ("one",)) is None
    with pytest.raises(ConfigError, match="needs --api-key"):
        ServerConfig(cache_salt_per_api_key=True)
