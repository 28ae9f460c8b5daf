"""--max-pending-requests counts sequences (prompts x n), not HTTP requests: a request of 64
prompts x n=16 takes the room of many, at most half the limit, so it can neither slip past
the limit as "one request" nor lock every other client out."""

from __future__ import annotations

import types

import pytest

from engine.errors import OverloadedError
from engine.server.api.sequence_admission import extra_charge, request_share, sequences_charged


def test_a_requests_sequences_are_charged_up_to_half_the_limit():
    assert request_share(256) == 128 and request_share(1) == 1
    assert extra_charge(pending=1, sequences=1, limit=256) == 0
    assert extra_charge(pending=1, sequences=4, limit=256) == 3
    assert extra_charge(pending=1, sequences=64 * 16, limit=256) == 127


def test_sequences_past_the_limit_are_a_503_naming_the_flag():
    with pytest.raises(OverloadedError, match=r"1024 sequences.*--max-pending-requests 256"
                       ) as caught:
        extra_charge(pending=200, sequences=64 * 16, limit=256)
    assert caught.value.status == 503


def test_the_charge_is_given_back_when_the_request_ends():
    state = types.SimpleNamespace(pending=1, config=types.SimpleNamespace(
        max_pending_requests=8))
    state.count = lambda pending: setattr(state, "pending", state.pending + pending)
    with sequences_charged(state, 3):
        assert state.pending == 3
        state.pending += 3  # three more requests' own slots
        with pytest.raises(OverloadedError), sequences_charged(state, 4):  # 6 + 3 > 8
            pass
        assert state.pending == 6
        state.pending -= 3
    assert state.pending == 1
