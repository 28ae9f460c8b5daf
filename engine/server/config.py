"""Typed server configuration, built by the CLI from flags (whose defaults are these fields'
defaults: written here once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig, EngineKind, PipelineConfig, VllmConfig
from engine.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None
    revision: str | None = None  # of a Hugging Face Hub model
    download_dir: str | None = None  # where hub models go (default: the Hugging Face cache)
    host: str = "127.0.0.1"
    port: int = 2242
    served_model_name: str | None = None
    chat_template: str | None = None
    #: the keys a client may send (vLLM's --api-key takes several too); None: no key
    api_key: tuple[str, ...] | None = None
    #: salt each request's cached work by its API key (engine.server.api.tenants)
    cache_salt_per_api_key: bool = False
    #: the key of the admin routes (the cache resets), apart from the users' --api-key;
    #: without it (or server_dev_mode) those routes are off
    admin_api_key: str | None = None
    #: vLLM's VLLM_SERVER_DEV_MODE: the admin routes open to the API's key holders
    server_dev_mode: bool = False
    #: media policy, video options, item limits, processor kwargs and cache: resolved once
    #: where the flags are read (clients may set only the bounded processor kwargs)
    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(request_kwargs="bounded"))
    mm_ipc_gpu_memory_gb: float = 0.0
    api_server_count: int = 1
    max_request_body_mb: float = 64.0
    request_body_timeout_s: float = 30.0
    #: seconds a new connection has to send its first request's headers
    header_read_timeout_s: float = 10.0
    #: seconds an idle connection stays open between requests
    keep_alive_timeout_s: float = 15.0
    max_connections_per_client: int = 256  # 0: no per-client cap
    #: networks whose X-Forwarded-For names the client (per-client fetch and decode shares)
    trusted_proxies: tuple[str, ...] | None = None  # (None: none trusted)
    #: text bytes / messages per request; None: what cannot fit max_model_len tokens
    max_prompt_bytes: int | None = None
    max_messages: int | None = None
    metrics_without_auth: bool = False
    expose_request_timings: bool = False
    #: a JSON file of the server's process ids by role, written once it serves (for tools
    #: that watch its processes: the benchmarks, the soak, the tests), removed at exit
    process_file: str | None = None
    #: vLLM's tool-calling flags: tool_choice "auto" reads the calls a model writes in
    #: ``tool_call_parser``'s format (engine/server/api/tool_parsers.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    #: vLLM's ``--generation-config``: "auto" (the model's generation_config.json), "vllm"
    #: (none) or a folder; the request defaults it gives are resolved by the supervisor
    #: into ``sampling_defaults`` (engine/models/generation_config.py)
    generation_config: str = "auto"
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: the engine's settings, checked where the flags are read and handed whole to the
    #: engine process (the launcher sets its reserved GPU bytes: mm_ipc_gpu_memory_gb)
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: which engine runs the model (``--engine``); vLLM's own settings when it is "vllm"
    engine_kind: EngineKind = "aphrodite"
    vllm: VllmConfig = field(default_factory=VllmConfig)
    max_model_len: int = 8192
    max_tokens_cap: int = 4096
    max_concurrent_fetches: int = 16
    max_fetches_per_client: int = 8  # 0: no per-client share
    max_pending_requests: int = 256
    decode_isolation: str = "process"  # decode worker processes; or "thread" (in-process)
    decode_workers: int = 2
    decode_timeout_s: float = 60.0
    decode_cpu_budget_s: float = 30.0  # CPU seconds of one isolated decode; 0: none
    decode_memory_gb: float = 8.0
    max_decode_queue: int = 64
    max_inflight_media_mb: float = 2048.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cache_salt_per_api_key and not self.api_key:
            raise ConfigError("--cache-salt-per-api-key salts by the API key a request "
                              "sends: it needs --api-key", code="invalid_flag",
                              hint="add --api-key KEY (once per tenant), or leave "
                                   "--cache-salt-per-api-key out")
