"""The server a load benchmark runs against (``bench serve``, ``sweep`` and ``soak``), resolved
from the target flags in one place: ``--base-url`` (or vLLM's ``--host``/``--port``) or
``--embedded`` (this project's server, started for the run and stopped after it), the
server's root URL, and the model name to send (``--model``, else the first of the target's
``GET /v1/models``; with ``--embedded``, ``--model`` is what the server serves and the name
is the one it lists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aphrodite_cli.bench.harness.server_process import ServerProcess
from aphrodite_cli.bench.load.client import first_model, server_root
from engine.errors import ConfigError

#: How long the embedded server may take to load its model and print its ready line.
READY_TIMEOUT_S = 300


class Target:
    """The target of one run. Made from the flags, it only checks them (a wrong combination
    fails before anything starts); ``with target:`` starts the embedded server when asked
    (media from the loopback host allowed, stage timings exposed), settles :attr:`root` and
    :attr:`model`, and stops the server on the way out."""

    def __init__(self, base_url: str | None = None, *, host: str | None = None,
                 port: int | None = None, embedded: bool = False, model: str | None = None,
                 engine: str = "aphrodite", api_key: str | None = None,
                 headers: dict[str, str] | None = None,
                 server_args: Sequence[str] = (),
                 server_env: dict[str, str] | None = None,
                 announce: Callable[[str], Any] | None = None) -> None:
        if base_url is None and (host or port):
            base_url = f"http://{host or '127.0.0.1'}:{port or 8000}"
        if embedded == bool(base_url):
            raise ConfigError("pass exactly one of --base-url URL (or --host/--port) or "
                              "--embedded", code="invalid_flag")
        if engine != "aphrodite" and not embedded:
            raise ConfigError(f"--engine {engine} chooses the embedded server's engine",
                              hint="add --embedded, or leave --engine out with --base-url",
                              code="invalid_flag")
        if engine == "vllm" and not model:
            raise ConfigError("--embedded --engine vllm needs --model: the default tiny model's "
                              "head_dim 16 is refused by vLLM's CPU attention",
                              hint="aphrodite model make-tiny qwen2_5_vl --out DIR (head_dim 32), "
                                   "then --model DIR", code="invalid_flag")
        if engine != "aphrodite":
            server_args = ("--engine", engine, *server_args)
        self.base_url, self.embedded, self.api_key = base_url, embedded, api_key
        self.headers = headers or {}  # --header: GET /v1/models carries them too
        self.model_flag, self.announce = model, announce
        self.server_args, self.server_env = tuple(server_args), server_env
        self.server: ServerProcess | None = None
        #: the server's root (no /v1) and the model name requests carry, once entered
        self.root = ""
        self.model = ""
        self.model_source = "--model"
        #: where the target says its model's weights came from (``root`` of GET /v1/models)
        self.model_root: str | None = None

    def __enter__(self) -> Target:
        if self.embedded:
            self.server = ServerProcess(
                *([self.model_flag] if self.model_flag else []), "--allowed-media-domains",
                "127.0.0.1", "--expose-request-timings", "--server-dev-mode",
                *self.server_args,
                env=self.server_env).wait_ready(READY_TIMEOUT_S)
        try:
            self.root = server_root(self.server.base if self.server else self.base_url or "")
            if self.model_flag and not self.embedded:
                self.model = self.model_flag
            else:
                self.model, self.model_root = first_model(self.root, self.api_key,
                                                          headers=self.headers)
                self.model_source = "first of GET /v1/models"
                if self.announce:
                    self.announce(f"model: {self.model} (the first of GET {self.root}/v1/models; "
                                  "--model picks another)")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.server:
            self.server.stop()
            self.server = None
