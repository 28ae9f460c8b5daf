"""One source per configuration fact: each ``serve`` flag's help, default, panel and rule are
its config field's (engine/settings.py), the rule is checked once where the config is built
(an error naming the flag), and the defaults other modules compare against are read, not
repeated."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from engine.config import (
    BALANCE_SLACK,
    EngineConfig,
    MediaLimits,
    MediaPolicy,
    ParallelConfig,
    PipelineConfig,
    VllmConfig,
)
from engine.errors import ConfigError
from engine.server.config import ServerConfig
from engine.settings import flag_of, settings

CLASSES = (ServerConfig, PipelineConfig, EngineConfig, ParallelConfig, VllmConfig)


def _serve_options():
    from aphrodite_cli.main import app

    command = typer.main.get_command(app).commands["serve"]
    return {p.name: p for p in command.params if isinstance(p, typer.core.TyperOption)}


def test_every_flag_setting_is_a_serve_option_with_the_fields_help_and_default():
    options = _serve_options()
    by_flag = {opt: p for p in options.values() for opt in p.opts}
    seen = 0
    for cls in CLASSES:
        for f in settings(cls):
            if not f.metadata["cli"]:
                continue
            option = by_flag[flag_of(f)]
            assert option.help == f.metadata["help"], f.name
            if f.name in ("model", "api_key", "chat_template", "trusted_proxies",
                          "kv_cache_memory_bytes"):  # parsed from text by serve itself
                continue
            assert option.default == f.default, f.name
            seen += 1
    assert seen >= 50
    assert by_flag["-q"] is by_flag["--quantization"]  # an alias declared on the field
    assert "--no-enable-auto-tool-choice" not in by_flag  # negatable=False


def test_serve_help_has_a_panel_per_config_class():
    from aphrodite_cli.serve import PANELS

    panels: dict[str, list[str]] = {}
    for p in _serve_options().values():
        panels.setdefault(p.rich_help_panel or "Options", []).append(p.opts[0])
    assert "Options" not in panels  # (Typer's own panel holds --help alone)
    assert list(panels) == list(PANELS)  # in the declared order, none empty
    assert "--data-parallel-size" in panels[ParallelConfig.PANEL]
    assert "--max-num-seqs" in panels[EngineConfig.PANEL]
    assert "--gpu-memory-utilization" in panels[VllmConfig.PANEL]


@pytest.mark.parametrize(("cls", "settings_", "message"), [
    (ServerConfig, {"port": 0}, "--port must be a whole number of at least 1 and at most "
                                "65535, not 0"),
    (ServerConfig, {"port": 70000}, "--port must be"),
    (ServerConfig, {"api_server_count": 65}, "--api-server-count must be"),
    (ServerConfig, {"decode_isolation": "fork"}, "--decode-isolation 'fork' is not supported"),
    (ServerConfig, {"engine_kind": "tgi"}, "--engine 'tgi' is not supported"),
    (ServerConfig, {"max_model_len": 8}, "--max-model-len must be a whole number of at least 16"),
    (ServerConfig, {"decode_timeout_s": float("nan")}, "--decode-timeout-s must be a number"),
    (ServerConfig, {"metrics_without_auth": "yes"}, "--metrics-without-auth must be true or"),
    (ServerConfig, {"tool_call_parser": "mistral"}, "--tool-call-parser 'mistral'"),
    (ServerConfig, {"enable_auto_tool_choice": True}, "needs --tool-call-parser"),
    (PipelineConfig, {"mm_processor_cache_gb": -1}, "--mm-processor-cache-gb must be"),
    (VllmConfig, {"gpu_memory_utilization": 0}, "--gpu-memory-utilization must be a number "
                                                "greater than 0 and at most 1, not 0"),
    (VllmConfig, {"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be"),
    (ParallelConfig, {"pipeline_parallel_size": 0}, "--pipeline-parallel-size must be"),
    (EngineConfig, {"quantization": "int4"}, "--quantization 'int4' is not supported"),
    (EngineConfig, {"long_prefill_token_threshold": -1},
     "--long-prefill-token-threshold must be a whole number of at least 0, not -1"),
])
def test_a_value_that_breaks_its_fields_rule_is_a_config_error_naming_the_flag(
        cls, settings_, message):
    with pytest.raises(ConfigError) as info:
        cls(**settings_)
    assert message in info.value.message
    assert info.value.hint


def test_the_cli_reports_a_broken_rule_as_the_config_error():
    """No Typer min/max: ``serve --port 0`` reaches the config, whose check names the flag."""
    from aphrodite_cli.main import app

    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert isinstance(result.exception, ConfigError), result.output
    assert "--port must be a whole number of at least 1" in result.exception.message


def test_defaults_that_other_places_compare_against_are_read_not_repeated(monkeypatch):
    from engine import envs
    from engine.server.vllm_adapter.vllm_spec import _OURS_ONLY, ours_only_flags

    # vLLM's refusals: every default of our engine passes, any change of one is named
    assert ours_only_flags(EngineConfig()) == []
    for name in _OURS_ONLY:
        f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
        changed = {"device": "cuda", "num_threads": 3, "decode_threads": 1,
                   "prefix_cache_gb": 1.0, "encoder_cache_gb": 0.0}.get(name)
        if changed is None:
            continue
        flags = [flag for flag, _ in ours_only_flags(EngineConfig(**{name: changed}))]
        assert flags == [flag_of(f)], name
    # media caps: the environment variables' defaults, declared once in engine/envs.py
    limits = MediaLimits.from_env()
    for f in dataclasses.fields(MediaLimits):
        if "env" in f.metadata:
            assert f.default == envs.default(f.metadata["env"]) == getattr(limits, f.name)
    assert MediaPolicy().max_redirects == envs.default("APHRODITE_MEDIA_MAX_REDIRECTS")
    monkeypatch.setenv("APHRODITE_MAX_VIDEO_FRAMES", "7")
    assert MediaLimits.from_env().max_video_frames == 7
    # a help string naming a constant reads it
    help_ = _serve_options()["data_parallel_size"].help
    assert f"at most {BALANCE_SLACK} requests busier" in help_


def test_both_engines_read_one_parallel_config():
    from engine.server.process.engine_pool import BALANCE_SLACK as pool_slack
    from engine.server.vllm_adapter.vllm_spec import engine_args

    assert pool_slack == BALANCE_SLACK
    config = ServerConfig(engine_kind="vllm", parallel=ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=3))
    args = engine_args(config, "/m", "m")
    assert (args["tensor_parallel_size"], args["data_parallel_size"]) == (2, 3)
    assert not {f.name for f in dataclasses.fields(ParallelConfig)} & {
        f.name for f in dataclasses.fields(VllmConfig)}


def _setting_type(cls: type, f: dataclasses.Field):
    import sys

    return f.type if not isinstance(f.type, str) else eval(f.type, vars(sys.modules[
        cls.__module__]))


def _choice_settings():
    """(class, field) of every ``serve`` flag with choices."""
    return [(cls, f) for cls in CLASSES for f in settings(cls)
            if f.metadata["cli"] and f.metadata["choices"] is not None]


def test_a_literal_typed_setting_declares_the_literals_values_as_its_choices():
    """The choices ``serve`` shows and checks are the field's ``choices``: a field typed with a
    ``Literal`` lists the same values, so the type and the flag cannot drift apart."""
    import typing

    literals = 0
    for cls in (*CLASSES, MediaPolicy):
        for f in settings(cls):
            kind = _setting_type(cls, f)
            literal = typing.get_origin(kind) is typing.Literal
            args = (kind,) if literal else typing.get_args(kind)
            for arg in args:
                if typing.get_origin(arg) is typing.Literal:
                    literals += 1
                    values = tuple(v for v in typing.get_args(arg) if v is not None)
                    if f.name == "data_parallel_size":  # a count or "auto" (serve parses it)
                        continue
                    assert f.metadata["choices"] == values, f.name
    assert literals >= 4
    names = {f.name for _, f in _choice_settings()}
    assert {"dtype", "quantization", "scheduling_policy", "engine_kind", "decode_isolation",
            "tool_call_parser", "distributed_executor_backend"} <= names


def _serve_help() -> str:
    from aphrodite_cli.main import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250",
                                                                "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def test_serve_help_shows_each_choice_flags_choices():
    """As Typer shows a Literal: ``--dtype <auto|float32|bfloat16|float16>``, not ``<str>``."""
    from engine.config import DEVICES

    lines = {}
    for line in _serve_help().splitlines():
        words = line.strip("│ ").split()
        if words and words[0].startswith("-"):
            lines[words[0]] = line
    for _, f in _choice_settings():
        line = lines[flag_of(f)]
        shown = "<" + "|".join(f.metadata["choices"]) + ">"
        assert shown in line and "<str>" not in line, line
    assert "<" + "|".join(DEVICES) + ">" in lines["--device"]
    # bench decode-step's --quantization is serve's: the same methods
    from aphrodite_cli.main import app
    from engine.config import QUANTIZATIONS

    bench = typer.main.get_command(app).commands["bench"].commands["decode-step"]
    quantization = next(p for p in bench.params if "--quantization" in p.opts)
    assert quantization.metavar == "<" + "|".join(QUANTIZATIONS) + ">"


@pytest.mark.parametrize("cls_field", _choice_settings(), ids=lambda cf: flag_of(cf[1]))
def test_a_bad_choice_is_the_config_error_naming_the_flag_and_the_choices(cls_field):
    """Every choice flag, those typed with a Literal too: the config's one error (the flag,
    the value, the choices), not Typer's usage box."""
    from aphrodite_cli.main import app

    _, f = cls_field
    result = CliRunner().invoke(app, ["serve", flag_of(f), "bogus"])
    assert isinstance(result.exception, ConfigError), result.output
    assert result.exception.message == f"{flag_of(f)} 'bogus' is not supported"
    assert result.exception.hint.startswith(
        "use one of " + ", ".join(f.metadata["choices"])), result.exception.hint


def test_the_command_line_prints_a_bad_choice_as_one_line_and_its_hint(monkeypatch, capsys):
    import sys

    from aphrodite_cli.main import main

    monkeypatch.setattr(sys, "argv", ["aphrodite", "serve", "--scheduling-policy", "lifo"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["Error: --scheduling-policy 'lifo' is not supported",
                     "  hint: use one of fcfs, priority, shortest"], lines


def test_the_media_flags_every_command_shares_read_the_fields_help_and_defaults():
    """``--allowed-media-domains`` and ``--allowed-local-media-path`` in ``serve``, ``media
    probe`` and ``media decode``: the help and metavar of MediaPolicy's fields; the video
    backend and frame count named in help are the declared defaults."""
    from aphrodite_cli.main import app
    from engine import envs
    from engine.media.video.sampling import DEFAULT_NUM_FRAMES
    from engine.settings import field_of

    root = typer.main.get_command(app)
    commands = {"serve": root.commands["serve"],
                "media probe": root.commands["media"].commands["probe"],
                "media decode": root.commands["media"].commands["decode"]}
    backend = envs.default("APHRODITE_VIDEO_LOADER_BACKEND")
    for name, command in commands.items():
        by_flag = {opt: p for p in command.params for opt in p.opts}
        for field_name in ("allowed_domains", "allowed_local_path"):
            f = field_of(MediaPolicy, field_name)
            option = by_flag[flag_of(f)]
            assert option.help == f.metadata["help"], (name, field_name)
            assert option.metavar == f.metadata["metavar"], (name, field_name)
            assert option.default is None  # unset: the field's default (no host, no folder)
        if "--media-io-kwargs" in by_flag:
            assert f"or {backend} when unset" in by_flag["--media-io-kwargs"].help, name
    decode = {opt: p for p in commands["media decode"].params for opt in p.opts}
    assert f"or {backend} when unset" in decode["--backend"].help
    assert f"default {DEFAULT_NUM_FRAMES}" in decode["--num-frames"].help
    serve = {opt: p for p in commands["serve"].params for opt in p.opts}
    for field_name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
        f = field_of(PipelineConfig, field_name)
        assert serve[flag_of(f)].help == f.metadata["help"]
        assert serve[flag_of(f)].rich_help_panel == PipelineConfig.PANEL


def test_each_modalitys_caps_default_to_its_declared_variables(monkeypatch):
    """``MediaLimits()`` holds the defaults declared in engine/envs.py, per modality too;
    ``from_env`` reads the variables."""
    from engine import envs
    from engine.config import MODALITIES, ModalityLimits

    for modality in MODALITIES:
        M = modality.upper()
        expected = ModalityLimits(envs.default(f"APHRODITE_MAX_{M}_BYTES"),
                                  envs.default(f"APHRODITE_{M}_FETCH_TIMEOUT"))
        assert getattr(MediaLimits(), modality) == expected == \
            getattr(MediaLimits.from_env(), modality)
    monkeypatch.setenv("APHRODITE_MAX_VIDEO_BYTES", "5")
    monkeypatch.setenv("APHRODITE_AUDIO_FETCH_TIMEOUT", "2.5")
    limits = MediaLimits.from_env()
    assert (limits.video.max_bytes, limits.audio.fetch_timeout_s) == (5, 2.5)
    assert limits.image == MediaLimits().image
    assert MediaLimits().video.max_bytes == envs.default("APHRODITE_MAX_VIDEO_BYTES")


def test_the_long_prefill_threshold_is_a_serve_flag_with_a_default_per_device():
    """--long-prefill-token-threshold (vLLM's flag): its help says what it does and its
    default, 512 on a CPU and off on a GPU; a negative value is refused naming the flag, on
    the command line too; --engine vllm gets it by vLLM's name when given."""
    from aphrodite_cli.main import app
    from engine.config import DEFAULT_LONG_PREFILL_TOKENS
    from engine.server.vllm_adapter.vllm_spec import engine_args

    assert DEFAULT_LONG_PREFILL_TOKENS == {"cpu": 512, "cuda": 0}
    assert EngineConfig().long_prefill_tokens == 512
    assert EngineConfig(device="cuda:0").long_prefill_tokens == 0
    assert EngineConfig(device="cuda", long_prefill_token_threshold=256).long_prefill_tokens \
        == 256
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_tokens == 0
    assert EngineConfig.create(long_prefill_token_threshold=64).long_prefill_tokens == 64
    help_ = _serve_options()["long_prefill_token_threshold"].help
    assert "chunks of at most this many" in help_ and "0 turns it off" in help_
    assert "Default: 512 on a CPU" in help_ and "0 (off) on a GPU" in help_
    assert "--long-prefill-token-threshold" in _serve_help()
    result = CliRunner().invoke(app, ["serve", "--long-prefill-token-threshold", "-5"])
    assert isinstance(result.exception, ConfigError), result.output
    assert result.exception.message == \
        "--long-prefill-token-threshold must be a whole number of at least 0, not -5"
    # --engine vllm: passed through when given (0 too), vLLM's own default otherwise
    assert "long_prefill_token_threshold" not in engine_args(
        ServerConfig(engine_kind="vllm"), "/m", "m")
    for value in (0, 256):
        config = ServerConfig(engine_kind="vllm", engine=EngineConfig(
            long_prefill_token_threshold=value))
        assert engine_args(config, "/m", "m")["long_prefill_token_threshold"] == value


def test_enforce_eager_reaches_vllm_and_contradicting_compile_decode_is_refused():
    """--enforce-eager (vLLM's flag): --engine vllm gets ``enforce_eager`` when it is given
    and vLLM's default (compiled) otherwise; this project's engine is eager already, so the
    flag alone is accepted there and with --compile-decode it is a flag error naming both."""
    from engine.server.engines import engines_for
    from engine.server.vllm_adapter.vllm_spec import engine_args

    assert "--enforce-eager" in _serve_help()
    assert "enforce_eager" not in engine_args(ServerConfig(engine_kind="vllm"), "/m", "m")
    eager = VllmConfig(enforce_eager=True)
    assert engine_args(ServerConfig(engine_kind="vllm", vllm=eager), "/m", "m")[
        "enforce_eager"] is True
    engines_for(ServerConfig(vllm=eager)).check_flags(ServerConfig(vllm=eager))
    both = ServerConfig(vllm=eager, engine=EngineConfig(compile_decode=True))
    with pytest.raises(ConfigError, match="--enforce-eager with --compile-decode") as err:
        engines_for(both).check_flags(both)
    assert err.value.code == "invalid_flag"
