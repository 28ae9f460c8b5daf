"""The target of `bench serve`, `sweep` and `soak`: their shared flags mean the same on every
command, and one resolution turns them into a server root and a model name."""

from __future__ import annotations

import json

import pytest
import typer

from aphrodite_cli.bench.cli import app
from aphrodite_cli.bench.load.target import Target
from engine.errors import ConfigError
from tests.fixtures import MediaHost

SHARED = {"serve": ("base_url", "host", "port", "endpoint", "embedded", "model", "api_key",
                    "mode", "num_warmups", "burstiness", "items_per_request", "bucket_config",
                    "prompt_len", "output_len", "media_delivery", "max_failure_rate", "seed",
                    "out_dir", "output_format", "request_timeout", "max_response_mb"),
          "soak": ("embedded", "bucket_config", "seed", "out_dir", "output_format")}


def params(name: str) -> dict:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name}


@pytest.mark.parametrize("other", ["sweep", "soak"])
def test_shared_flags_have_the_same_spellings_help_and_ranges(other):
    theirs, serve = params(other), params("serve")
    for name in SHARED["soak" if other == "soak" else "serve"]:
        a, b = serve[name], theirs[name]
        assert (a.opts, a.secondary_opts, a.help, a.metavar, a.min, a.max) == (
            b.opts, b.secondary_opts, b.help, b.metavar, b.min, b.max), name


def test_the_target_is_one_of_a_url_or_the_embedded_server():
    for flags in ({}, {"base_url": "http://h:1", "embedded": True},
                  {"host": "h", "embedded": True}):
        with pytest.raises(ConfigError, match="exactly one of --base-url"):
            Target(**flags)
    assert Target(host="gpu-box").base_url == "http://gpu-box:8000"
    assert Target(port=9000).base_url == "http://127.0.0.1:9000"


def test_the_model_is_the_flag_or_the_first_the_target_lists():
    host = MediaHost()
    try:
        host.add("/v1/models", json.dumps({"data": [{"id": "acme/vlm"}, {"id": "b"}]}).encode(),
                 "application/json")
        said: list[str] = []
        with Target(f"{host.base}/v1/", announce=said.append) as target:
            assert (target.root, target.model) == (host.base, "acme/vlm")
            assert target.model_source == "first of GET /v1/models" and said
        with Target(f"{host.base}/v1/chat/completions", model="mine") as target:
            assert (target.root, target.model, target.model_source) == (
                host.base, "mine", "--model")
        assert host.hits["/v1/models"] == 1  # --model: nothing asked
    finally:
        host.stop()


def test_a_target_without_a_model_list_names_the_flags_that_fix_it():
    host = MediaHost()
    try:
        with pytest.raises(ConfigError, match=r"GET .*/v1/models answered 404"), \
                Target(host.base):
            pass
    finally:
        host.stop()
