"""``LoadConfig`` in parts (the target, the arrivals, the media, then how answers are read):
a result's ``config`` still holds every field flat, by the name its flag gives it, so result
files and their readers do not change with the split."""

from __future__ import annotations

import math
from dataclasses import fields

from aphrodite_cli.bench.load.client import (
    ArrivalConfig,
    LoadConfig,
    MediaConfig,
    TargetConfig,
    document,
)

#: the result's config fields (as written before the split into parts)
FLAT = {"base_url", "endpoint", "model", "api_key", "admin_api_key", "request_rate",
        "burstiness", "max_concurrency", "seed", "media_delivery", "image_format",
        "image_quality", "video_codec", "video_fps", "video_gop", "timeout_s",
        "max_response_bytes", "keep_text", "ttft_from", "goodput", "temperature",
        "ignore_eos", "ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps",
        "abort_after", "headers", "extra_body", "cancel_rate", "cancel_delay_s",
        "num_workers"}


def test_a_results_config_is_flat_and_keeps_its_field_names():
    cfg = LoadConfig(TargetConfig("http://127.0.0.1:1", model="m", api_key="secret",
                                  headers={"X-Key": "token"}),
                     ArrivalConfig(request_rate=math.inf, max_concurrency=4),
                     MediaConfig(media_delivery="http"), seed=7)
    config = document(cfg, {}, {})["config"]
    assert set(config) == FLAT
    assert config["request_rate"] == "inf" and config["max_concurrency"] == 4
    assert config["media_delivery"] == "http" and config["seed"] == 7
    # secrets stay out of result files, whichever part holds them
    assert config["api_key"] == "(set)" and config["headers"] == {"X-Key": "(set)"}


def test_no_two_parts_share_a_field_name():
    """The flat form is lossless only while every name is in one part."""
    names = [f.name for part in (TargetConfig, ArrivalConfig, MediaConfig)
             for f in fields(part)]
    names += [f.name for f in fields(LoadConfig)
              if f.name not in ("target", "arrivals", "media")]
    assert len(names) == len(set(names)) and set(names) == FLAT


def test_other_arrivals_leave_the_load_as_it_was():
    cfg = LoadConfig(TargetConfig("x"), ArrivalConfig(request_rate=5.0, burstiness=2.0))
    point = cfg.with_arrivals(request_rate=9.0, max_concurrency=2)
    assert (point.arrivals.request_rate, point.arrivals.burstiness,
            point.arrivals.max_concurrency) == (9.0, 2.0, 2)
    assert cfg.arrivals.request_rate == 5.0 and cfg.arrivals.max_concurrency is None
    assert point.target is cfg.target and point.media is cfg.media
