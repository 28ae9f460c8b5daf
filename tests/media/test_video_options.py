"""Backend selection and typed options: server-wide, env var and per-request."""

from __future__ import annotations

import logging

import pytest

from engine.errors import ConfigError, InvalidRequestError
from engine.media.video.options import (
    DeepStreamOptions,
    PyAVOptions,
    TorchCodecOptions,
    parse_video_io_kwargs,
    server_video_spec,
)
from engine.media.video.sampling import SamplingRequest, sample_indices


def test_env_var_picks_the_default_backend(monkeypatch):
    monkeypatch.setenv("APHRODITE_VIDEO_LOADER_BACKEND", "pyav")
    assert server_video_spec(None).backend == "pyav"
    monkeypatch.delenv("APHRODITE_VIDEO_LOADER_BACKEND")
    assert server_video_spec(None).backend == "opencv"


def test_flag_wins_over_env_and_options_are_typed(monkeypatch):
    monkeypatch.setenv("APHRODITE_VIDEO_LOADER_BACKEND", "pyav")
    spec = server_video_spec({"video": {"backend": "torchcodec", "seek_mode": "approximate",
                                        "num_ffmpeg_threads": 2, "num_frames": 16}})
    assert spec.backend == "torchcodec"
    assert spec.options == TorchCodecOptions(num_ffmpeg_threads=2, seek_mode="approximate")
    assert spec.sampling == SamplingRequest(num_frames=16)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        server_video_spec({"video": {"backend": "ffmpeg-gpu"}})
    for name in ("opencv", "pyav", "torchcodec", "pynvvideocodec", "deepstream"):
        assert name in info.value.message


def test_option_of_another_backend_names_option_and_backend():
    with pytest.raises(ConfigError) as info:
        server_video_spec({"video": {"backend": "pyav", "seek_mode": "exact"}})
    assert "'seek_mode'" in info.value.message and "torchcodec" in info.value.message
    assert info.value.code == "video_option_wrong_backend"


def test_unknown_option_and_bad_values():
    with pytest.raises(ConfigError, match="unknown video option 'turbo'"):
        server_video_spec({"video": {"backend": "pyav", "turbo": True}})
    with pytest.raises(ConfigError, match="seek_mode='fast' must be one of exact, approximate"):
        server_video_spec({"video": {"backend": "torchcodec", "seek_mode": "fast"}})
    with pytest.raises(ConfigError, match="threads=-1"):
        server_video_spec({"video": {"backend": "pyav", "threads": -1}})
    with pytest.raises(ConfigError, match="num_frames"):
        server_video_spec({"video": {"num_frames": 0}})


def test_request_merges_over_server_settings():
    server = server_video_spec({"video": {"backend": "pyav", "threads": 2, "num_frames": 8}})
    same = parse_video_io_kwargs({"fps": 2.0}, server)
    assert same.options == PyAVOptions(threads=2) and same.sampling.num_frames == 8
    assert same.sampling.fps == 2.0
    other = parse_video_io_kwargs({"backend": "torchcodec", "seek_mode": "approximate"}, server)
    assert other.backend == "torchcodec" and other.sampling.num_frames == 8
    with pytest.raises(InvalidRequestError) as info:
        parse_video_io_kwargs({"backend": "opencv", "threads": 2}, server)
    assert info.value.status == 400 and "belongs to the pyav backend" in info.value.message


@pytest.mark.parametrize("gpu", ["pynvvideocodec", "deepstream"])
def test_gpu_backend_per_request_only_if_the_server_started_with_it(gpu):
    server = server_video_spec(None)
    with pytest.raises(InvalidRequestError) as info:
        parse_video_io_kwargs({"backend": gpu}, server)
    assert info.value.code == "video_backend_not_enabled"
    assert "--media-io-kwargs" in info.value.hint
    started = server_video_spec({"video": {"backend": gpu}})
    assert parse_video_io_kwargs({"backend": gpu, "num_frames": 4}, started).backend == gpu


def test_startup_only_options_are_refused_per_request_unless_the_servers():
    """An option the backend fixes when the server starts would have no effect per request:
    the server's own value is taken, another is a 400 naming the option."""
    server = server_video_spec({"video": {"backend": "pynvvideocodec", "hw_decoders": 3}})
    assert parse_video_io_kwargs({"hw_decoders": 3}, server).options.hw_decoders == 3
    with pytest.raises(InvalidRequestError) as caught:
        parse_video_io_kwargs({"hw_decoders": 9}, server)
    assert caught.value.status == 400 and caught.value.code == "invalid_video_option"
    assert caught.value.param == "media_io_kwargs.video.hw_decoders"
    assert "--media-io-kwargs" in str(caught.value)


def test_deepstream_pool_size_defaults_and_clamps(monkeypatch, caplog):
    monkeypatch.setenv("APHRODITE_MEDIA_LOADING_THREAD_COUNT", "5")
    assert DeepStreamOptions().pool_size == 5
    with caplog.at_level(logging.WARNING):
        assert DeepStreamOptions(pool_size=64).pool_size == 16
    assert "clamped" in caplog.text


@pytest.mark.parametrize("total,fps,request_,expected", [
    (300, 30.0, SamplingRequest(num_frames=4), [0, 100, 199, 299]),
    (10, 30.0, SamplingRequest(num_frames=32), list(range(10))),
    (300, 30.0, SamplingRequest(num_frames=32, fps=1.0), [0, 33, 66, 100, 133, 166, 199, 233,
                                                           266, 299]),
    (300, 30.0, SamplingRequest(num_frames=4, max_duration=2.0), [0, 20, 39, 59]),
    (1, 30.0, SamplingRequest(), [0]),
    (0, None, SamplingRequest(), []),
])
def test_sampler(total, fps, request_, expected):
    assert sample_indices(total, fps, request_) == expected


def test_sampling_request_validation():
    for bad in ({"num_frames": 0}, {"num_frames": 5000}, {"fps": -1}, {"max_duration": 0},
                {"num_frames": True}, {"fps": float("nan")}):
        with pytest.raises(InvalidRequestError):
            SamplingRequest(**bad)


def test_a_request_may_ask_for_fewer_frames_never_more_than_the_servers_maximum():
    """Frames are the memory a video request causes (decoded RGB, then the processor's
    tensors): per request, num_frames is capped at the server's own (or the default 32),
    refused before anything is fetched or decoded."""
    from engine.media.video.options import parse_video_io_kwargs, server_video_spec

    server = server_video_spec({"video": {"backend": "pyav", "num_frames": 48}})
    assert parse_video_io_kwargs({"num_frames": 8}, server).sampling.num_frames == 8
    assert parse_video_io_kwargs({"num_frames": 48}, server).sampling.num_frames == 48
    with pytest.raises(InvalidRequestError) as info:
        parse_video_io_kwargs({"num_frames": 49}, server)
    assert info.value.code == "invalid_video_sampling" and "--media-io-kwargs" in info.value.hint
    small = server_video_spec({"video": {"num_frames": 4}})
    assert parse_video_io_kwargs({"num_frames": 32}, small).sampling.num_frames == 32
    with pytest.raises(InvalidRequestError):
        parse_video_io_kwargs({"num_frames": 1024}, small)


def test_every_backend_fact_comes_from_its_one_record():
    """backend_info.BACKENDS is the one table: the env var's choices, the options classes, the
    registry's modules, the GPU gate and the start-only options all follow it."""
    from engine import envs
    from engine.media.video.backend_info import BACKENDS, GPU_NAMES
    from engine.media.video.options import OPTION_CLASSES
    from engine.media.video.registry import get_backend

    assert tuple(BACKENDS) == envs.VIDEO_BACKENDS == tuple(OPTION_CLASSES)
    for name, info in BACKENDS.items():
        assert OPTION_CLASSES[name].backend == name
        assert set(info.startup_only) <= set(OPTION_CLASSES[name].names())
        if not info.gpu:  # importable everywhere: the registry's module is the record's
            backend = get_backend(name)
            assert backend.name == name and type(backend).__module__ == info.module
            assert not backend.gpu
    assert {"pynvvideocodec", "deepstream"} == GPU_NAMES
    assert get_backend("deepstream").gpu  # GStreamer's software path is installed here
    server = server_video_spec(None)
    for name in GPU_NAMES:  # a GPU backend only when the server started with it
        with pytest.raises(InvalidRequestError) as info:
            parse_video_io_kwargs({"backend": name}, server)
        assert info.value.code == "video_backend_not_enabled"


def test_one_command_line_syntax_for_a_backend_and_its_options():
    """NAME:KEY=VALUE (JSON values where they parse) on every command that picks a backend;
    the result is the ``video`` dict --media-io-kwargs takes, checked by the same code."""
    from engine.media.video.options import build_spec, parse_backend_choices

    choices = parse_backend_choices("pyav:threads=2:skip_nonref=false, torchcodec:seek_mode="
                                    "approximate,opencv", flag="--backends")
    assert choices == [{"backend": "pyav", "threads": 2, "skip_nonref": False},
                       {"backend": "torchcodec", "seek_mode": "approximate"},
                       {"backend": "opencv"}]
    assert build_spec(choices[0], "opencv", error=ConfigError).options == PyAVOptions(
        threads=2, skip_nonref=False)
    with pytest.raises(ConfigError) as info:
        parse_backend_choices("pyav:threads", flag="--video-backends")
    assert "--video-backends" in info.value.message and "KEY=VALUE" in info.value.message
    with pytest.raises(ConfigError, match="threads"):
        build_spec(parse_backend_choices("pyav:threads=-1", flag="--backends")[0], "opencv",
                   error=ConfigError)


def test_a_backend_that_is_not_a_name_is_a_client_error():
    server = server_video_spec({"video": {"backend": "pyav"}})
    for bad in (["pyav"], {"x": 1}, 3, None):
        with pytest.raises(InvalidRequestError) as info:
            parse_video_io_kwargs({"backend": bad}, server)
        assert info.value.status == 400 and info.value.code == "unknown_video_backend"
