"""Synthetic media sizes are bounded before a byte is made: a flag or a trace row asking for
a terabyte array is a one-line error naming the flag (or row) and the cap."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aphrodite_cli.bench.data.datasets import parse_buckets
from aphrodite_cli.bench.load.archetypes import parse_archetypes
from aphrodite_cli.main import app
from engine.errors import ConfigError
from tests.fixtures import synthetic_caps

MAX_FRAMES, MAX_SIDE = synthetic_caps.MAX_FRAMES, synthetic_caps.MAX_SIDE


@pytest.mark.parametrize(("config", "says"), [
    ('{"100000,100000,1": 1}', f"past the {MAX_SIDE}-pixel side cap"),
    ('{"64,64,100000": 1}', f"past the {MAX_FRAMES}-frame cap"),
    ('{"4320,7680,3000": 1}', "pixels per video"),
    ('{"64,64,1": NaN}', "numbers from 0 to 1"),
    ('{"64,64,1": 2, "32,32,1": -1}', "numbers from 0 to 1"),
    ('{"64,64,1": true}', "numbers from 0 to 1"),
])
def test_bucket_config_sizes_and_probabilities_are_bounded(config, says):
    with pytest.raises(ConfigError, match=says) as info:
        parse_buckets(config)
    assert "--bucket-config" in info.value.message


def test_an_archetypes_buckets_are_bounded_too():
    with pytest.raises(ConfigError, match="--bucket-config: 99999x99999"):
        parse_archetypes('{"huge": {"buckets": {"99999,99999,1": 1}}}')


@pytest.mark.parametrize(("args", "says"), [
    (["image", "x.png", "--width", "100000"], "--width"),
    (["video", "x.mp4", "--height", "9000"], "--height"),
    (["audio", "x.wav", "--seconds", "1e9"], "--seconds"),
    (["video", "x.mp4", "--seconds", "500", "--fps", "60"], "frame cap"),
    (["video", "x.mp4", "--width", "7680", "--height", "4320", "--seconds", "100"],
     "pixels per video"),
])
def test_media_generate_refuses_sizes_past_the_caps_before_making_them(tmp_path, args, says):
    args[1] = str(tmp_path / args[1])
    result = CliRunner().invoke(app, ["media", "generate", *args])
    assert result.exit_code != 0
    # typer's range check prints its usage error; ours reaches the CLI's one-line handler
    assert says in result.output + str(result.exception or "")
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.mp4").exists()
