"""tests/tiers.py: a test's tier markers come from its folder and from the fixtures it asks."""

from __future__ import annotations

import pytest

from tests.tiers import TierError, tiers_of


def test_a_tests_folder_is_its_tier():
    assert tiers_of("engine", ["tmp_path"]) == {"engine"}
    assert tiers_of("unit", ["tmp_path", "monkeypatch"]) == {"unit"}
    assert tiers_of("tests", []) == set()  # a module beside the folders has no tier


def test_a_fixture_brings_its_tier_into_any_folder():
    assert tiers_of("bench", ["served", "tmp_path"]) == {"bench", "server"}
    assert tiers_of("engine", ["media_server"]) == {"engine", "media"}
    assert tiers_of("vllm", ["served", "media_server"]) == {"vllm", "server", "media"}


@pytest.mark.parametrize("fixture, tier", [("served", "server"), ("media_server", "media")])
def test_a_unit_test_that_asks_a_server_or_media_is_refused_naming_where_it_goes(fixture, tier):
    with pytest.raises(TierError, match=f"'{fixture}' fixture .*move it to tests/{tier}/"):
        tiers_of("unit", ["tmp_path", fixture])
