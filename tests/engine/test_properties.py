"""Property-based tests: whatever a client sends, parsing answers with a 4xx or a result,
never an unexpected exception (a 500)."""

from __future__ import annotations

import base64

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.config import MediaLimits, MediaPolicy
from engine.errors import ClientError
from engine.media.data_url import decode_base64_payload
from engine.media.policy import parse_source
from engine.processing.chat_parts import parse_messages

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "video_url", "audio_url"]),
                           "image_url": json_values}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": json_values}),
    st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)
message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x", ""]),
    "content": st.one_of(st.text(max_size=20), st.lists(part, max_size=4), json_values)})


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(message, max_size=4), json_values))
def test_content_part_parsing_only_raises_client_errors(messages):
    try:
        parsed = parse_messages(messages)
    except ClientError as err:
        assert err.status == 400
    else:
        assert len(parsed.media) == sum(
            1 for m in parsed.messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] in ("image", "video", "audio"))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_base64_round_trips_in_both_alphabets_with_or_without_padding(data):
    assert decode_base64_payload(base64.b64encode(data).decode()) == data
    assert decode_base64_payload(base64.urlsafe_b64encode(data).decode().rstrip("=")) == data


_B64_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_=")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
@example("aGVsbG8")  # valid without padding
@example("aGVs bG8=")  # inner space
@example("a")  # a length no base64 text has
@example("aGVsbG8=\x00")
def test_base64_of_any_text_is_bytes_or_a_client_error(text):
    """Garbage is refused with the data-URL rule: a character outside both base64 alphabets,
    or a length that no base64 text has (one char past a 4-char group), is always an error;
    what decodes re-encodes to the same characters (no bytes invented or dropped)."""
    body = text.strip()
    must_fail = bool(set(body) - _B64_CHARS) or len(body.rstrip("=")) % 4 == 1
    try:
        data = decode_base64_payload(text)
    except ClientError as err:
        assert err.code == "media_data_url_malformed" and err.status == 400
    else:
        assert not must_fail, f"{text!r} decoded to {data!r}"
        canonical = body.replace("-", "+").replace("_", "/").rstrip("=")
        assert base64.b64encode(data).decode().rstrip("=")[: len(canonical) - 1] == \
            canonical[: len(canonical) - 1]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.text(max_size=80))
def test_data_urls_of_any_shape_parse_or_refuse(header, payload):
    try:
        source = parse_source(f"data:{header},{payload}", "image", MediaPolicy.create(),
                              MediaLimits.from_env())
    except ClientError as err:
        assert 400 <= err.status < 500
    else:
        assert source.kind == "data" and source.data_payload == payload


_PIECES = ["127.0.0.1", "169.254.169.254", "10.0.0.1", "media.example", "evil.example", "@",
           "\\", "#", "?", "/", ":80", ":", "%40", "%2f", "%00", ".", "[", "]", "::1", " ",
           "\t", "user:pw", "\u3002", "%2e"]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["http://", "https://", "HTTP://", "http:/", "http:\\\\"]),
       st.lists(st.sampled_from(_PIECES), min_size=1, max_size=7))
# Found by random exploration (make fuzz); pinned so every run checks them:
@example("http://", ["127.0.0.1", "."])  # trailing dot: one host, normalised for both
@example("http://", ["127.0.0.1", "\u3002"])  # ideographic full stop (IDNA maps it to ".")
@example("http://", ["[", "]", "@", "/"])  # http://[]@/ made the URL library raise IndexError
@example("http://", ["media.example", ".", ":80", "/"])
def test_no_parser_differential_between_the_check_and_the_fetch(scheme, pieces):
    """Whatever a URL looks like, if the policy accepts it, the host it checked is the host
    the fetcher (yarl) and Python's own parser connect to, and it is on the allow-list."""
    from urllib.parse import urlsplit

    url = scheme + "".join(pieces)
    policy = MediaPolicy.create(allowed_domains=["media.example", "127.0.0.1"])
    try:
        source = parse_source(url, "image", policy, MediaLimits.from_env())
    except ClientError as err:
        assert err.status == 400
        return
    assert source.host in ("media.example", "127.0.0.1")
    assert source.http_url is not None and source.http_url.raw_host == source.host
    assert source.http_url.host == source.host
    assert urlsplit(str(source.http_url)).hostname == source.host


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40), st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|video_pad|>",
     "<|endoftext|>"]))
def test_control_tokens_are_refused_wherever_they_sit_in_text(before, after, token):
    from engine.errors import InvalidRequestError
    from engine.processing.prompt import check_message_text
    from tests.engine_fixtures import loaded

    model = loaded("qwen2_5_vl")
    try:
        check_message_text(model, [{"role": "user", "content": before + token + after}])
    except InvalidRequestError as err:
        assert err.code == "control_token_in_text"
    else:
        raise AssertionError(f"{token!r} in text was accepted")
