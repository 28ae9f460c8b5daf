"""Typed server configuration, built by the CLI from flags. Each flag's help, default and rule
is declared here once, on its field (:func:`engine.settings.setting`): ``serve``'s options
are generated from these fields (``aphrodite_cli/config_flags.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from engine.config import (
    ENGINE_KINDS,
    EngineConfig,
    EngineKind,
    ParallelConfig,
    PipelineConfig,
    VllmConfig,
)
from engine.errors import ConfigError
from engine.settings import check, setting

#: the tool-call formats --tool-call-parser takes (each read by engine/server/api/tool_parsers.py)
PARSERS = ("hermes",)
_LIMITS = "Requests and connections"
_DECODE = "Media fetch and decode"


@dataclass(frozen=True)
class ServerConfig:
    PANEL: ClassVar[str] = "Server"

    model: str | None = None
    revision: str | None = setting(None, help="Branch, tag or commit of a hub model, e.g. main.")
    download_dir: str | None = setting(
        None, help="Folder to download hub models into instead of the Hugging Face cache.")
    host: str = setting("127.0.0.1", help="Address to listen on, e.g. 0.0.0.0.")
    port: int = setting(2242, ge=1, le=65535, example="8000", help="Port, e.g. 8000.")
    served_model_name: str | None = setting(
        None, help="Name clients use in 'model', e.g. my-vlm.")
    chat_template: str | None = setting(
        None, help="Jinja chat template file, e.g. engine/models/templates/llava.jinja.")
    #: the keys a client may send (vLLM's --api-key takes several too); None: no key
    api_key: tuple[str, ...] | None = setting(
        None, metavar="KEY",
        help="Require 'Authorization: Bearer KEY' (or set APHRODITE_API_KEY); repeat it to "
             "accept several keys, e.g. --api-key team-a --api-key team-b.")
    #: salt each request's cached work by its API key (engine.server.api.tenants)
    cache_salt_per_api_key: bool = setting(
        False, help="Salt each request's cached work by its API key (combined with any "
                    "cache_salt it sends): the holders of different keys share no cached "
                    "prompt tokens, processed media or media uuids. Needs --api-key.")
    admin_api_key: str | None = setting(
        None, help="Key of the admin routes (POST /reset_mm_cache, /reset_prefix_cache: they "
                   "empty every client's caches), apart from --api-key (or set "
                   "APHRODITE_ADMIN_API_KEY). Without it or --server-dev-mode those routes "
                   "answer 404.")
    server_dev_mode: bool = setting(
        False, help="Open the admin routes to --api-key holders (or anyone, without a key) "
                    "with no admin key, as vLLM's VLLM_SERVER_DEV_MODE (or set "
                    "APHRODITE_SERVER_DEV_MODE=1).")
    #: media policy, video options, item limits, processor kwargs and cache: resolved once
    #: where the flags are read (clients may set only the bounded processor kwargs)
    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(request_kwargs="bounded"))
    mm_ipc_gpu_memory_gb: float = setting(
        0.0, ge=0, example="4", panel=_DECODE,
        help="GPU memory for video decoding, split among API servers, e.g. 4.")
    api_server_count: int = setting(
        1, ge=1, le=64, example="2",
        help="API server processes sharing the port, e.g. 2.")
    max_request_body_mb: float = setting(
        64.0, ge=0.001, example="64", panel=_LIMITS,
        help="Largest request body in MB, e.g. 64.")
    request_body_timeout_s: float = setting(
        30.0, ge=0.1, example="30", panel=_LIMITS,
        help="Seconds a client has to send its whole request body (else 408), e.g. 30.")
    header_read_timeout_s: float = setting(
        10.0, ge=0.1, example="10", panel=_LIMITS,
        help="Seconds a new connection has to send its first request's headers (else it is "
             "closed), e.g. 10.")
    keep_alive_timeout_s: float = setting(
        15.0, ge=0.1, example="15", panel=_LIMITS,
        help="Seconds an idle connection stays open between requests, e.g. 15.")
    max_connections_per_client: int = setting(
        256, ge=0, example="256", panel=_LIMITS,
        help="Open connections one client (its peer address) may hold per API server; past "
             "it a new one replaces the client's oldest idle one (503 and close when all are "
             "busy); 0: no per-client cap, e.g. 256.")
    #: networks whose X-Forwarded-For names the client (per-client fetch and decode shares)
    trusted_proxies: tuple[str, ...] | None = setting(
        None, panel=_LIMITS,
        help="Reverse proxies (addresses or CIDR networks, comma-separated, e.g. "
             "10.0.0.0/8,127.0.0.1) whose X-Forwarded-For names the client: per-client fetch "
             "and decode shares count the user behind the proxy. Connections still count "
             "peers.")
    max_prompt_bytes: int | None = setting(
        None, ge=1, example="1000000", panel=_LIMITS,
        help="Most bytes of text in one request's messages or prompt, checked before "
             "templating (400 prompt_too_long); default: what cannot fit --max-model-len "
             "tokens.")
    max_messages: int | None = setting(
        None, ge=1, example="1000", panel=_LIMITS,
        help="Most messages in one chat request, checked before templating (400 "
             "too_many_messages); default: --max-model-len.")
    metrics_without_auth: bool = setting(
        False, help="With --api-key, still serve /metrics without the key (for a scraper).")
    expose_request_timings: bool = setting(
        False, help="Send each request's server-side stage timings and cache hits to its "
                    "client (header x-aphrodite-timings, body field 'aphrodite'; bench serve "
                    "reads them). Off by default: a cache hit tells a client that someone "
                    "sent the same media.")
    #: a JSON file of the server's process ids by role, written once it serves (for tools
    #: that watch its processes: the benchmarks, the soak, the tests), removed at exit
    process_file: str | None = setting(
        None, help="Write the server's process ids by role to this JSON file once it serves "
                   "({\"supervisor\": PID, \"engines\": [...], \"api_servers\": [...]}), "
                   "for tools that watch its processes; removed at exit.")
    #: vLLM's tool-calling flags: tool_choice "auto" reads the calls a model writes in
    #: ``tool_call_parser``'s format (engine/server/api/tool_parsers.py)
    enable_auto_tool_choice: bool = setting(
        False, negatable=False, panel="Requests",
        help="Let tool_choice \"auto\" (the default when a request sends tools) through: "
             "the calls the model writes are read by --tool-call-parser (vLLM's flags). "
             "Without it such a request is a 400; named and \"required\" tool choices need "
             "neither (the grammar engine forces the call).")
    tool_call_parser: Literal["hermes"] | None = setting(
        None, choices=PARSERS, panel="Requests",
        help="How the model writes its tool calls, for --enable-auto-tool-choice: hermes "
             "(<tool_call>{\"name\", \"arguments\"}</tool_call>, Qwen2.5's and Qwen3-VL's "
             "templates).")
    #: vLLM's ``--generation-config``: "auto" (the model's generation_config.json), "vllm"
    #: (none) or a folder; the request defaults it gives are resolved by the supervisor
    #: into ``sampling_defaults`` (engine/models/generation_config.py)
    generation_config: str = setting(
        "auto", panel="Requests",
        help="Request defaults for temperature, top_p, top_k, min_p, repetition_penalty and "
             "max_tokens (from max_new_tokens) when a request leaves them out (vLLM's flag): "
             "auto, the model's own generation_config.json; vllm, none (neutral defaults); "
             "or a folder holding a generation_config.json. The defaults in use are logged "
             "at start-up.")
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: the engine's settings, checked where the flags are read and handed whole to the
    #: engine process (the launcher sets its reserved GPU bytes: mm_ipc_gpu_memory_gb)
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: which engine runs the model (``--engine``); vLLM's own settings when it is "vllm"
    engine_kind: EngineKind = setting(
        "aphrodite", flag="--engine", choices=ENGINE_KINDS, panel="Parallelism",
        help="aphrodite (this project's engine: one device, one process per "
             "--data-parallel-size) or vllm (vLLM's AsyncLLM in its own environment, "
             ".venv-vllm from `make setup-vllm`: tensor/pipeline/data parallel, several "
             "nodes with Ray; media still fetched and decoded here, processed by vLLM).")
    #: model copies and splits, for either engine
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    max_model_len: int = setting(
        8192, ge=16, example="8192", panel="Requests",
        help="Prompt plus output tokens per request, e.g. 8192.")
    max_tokens_cap: int = 4096
    max_concurrent_fetches: int = setting(
        16, ge=1, example="16", panel=_DECODE,
        help="http(s) media fetches in flight per API server (a request with http media "
             "holds one while it fetches; data URLs and local files none), e.g. 16.")
    max_fetches_per_client: int = setting(
        8, ge=0, example="8", panel=_DECODE,
        help="Of those, most held at once by one client (its peer address), so one client's "
             "slow media hosts cannot hold them all; 0: no per-client share (behind a "
             "reverse proxy every client has its address), e.g. 8.")
    max_pending_requests: int = setting(
        256, ge=1, example="256", panel=_LIMITS,
        help="Sequences in flight per API server before 503 + Retry-After (a request counts "
             "prompts x n, at most half of this), e.g. 256.")
    decode_isolation: Literal["process", "thread"] = setting(
        "process", choices=("process", "thread"), panel=_DECODE,
        help="process (decode worker processes: a decoder crash, hang or memory blow-up "
             "fails one request, not the server) or thread (in the API server, faster by "
             "one hand-over through shared memory).")
    decode_workers: int = setting(
        2, ge=1, example="4", panel=_DECODE,
        help="Decode worker processes per API server with --decode-isolation process, "
             "e.g. 4.")
    decode_timeout_s: float = setting(
        60.0, ge=0.1, example="60", panel=_DECODE,
        help="Wall-clock limit of one isolated decode in seconds, e.g. 60.")
    decode_cpu_budget_s: float = setting(
        30.0, ge=0, example="30", panel=_DECODE,
        help="CPU seconds (all threads) one isolated decode may use before it is stopped "
             "with a 422, e.g. 30; 0: no budget. With --decode-isolation thread: the "
             "decode's wall-clock seconds, checked between frames.")
    decode_memory_gb: float = setting(
        8.0, ge=0.25, example="8", panel=_DECODE,
        help="Address-space limit of one decode worker in GB, e.g. 8.")
    max_decode_queue: int = setting(
        64, ge=1, example="64", panel=_DECODE,
        help="Requests fetching/decoding/preprocessing per API server before 503 + "
             "Retry-After, e.g. 64.")
    max_inflight_media_mb: float = setting(
        2048.0, ge=0.01, example="2048", panel=_DECODE,
        help="Fetched media bytes held per API server before 503 + Retry-After, in MB, "
             "e.g. 2048.")
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self)  # each field's bounds and choices, declared on it
        if self.cache_salt_per_api_key and not self.api_key:
            raise ConfigError("--cache-salt-per-api-key salts by the API key a request "
                              "sends: it needs --api-key", code="invalid_flag",
                              hint="add --api-key KEY (once per tenant), or leave "
                                   "--cache-salt-per-api-key out")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser",
                              hint="add --tool-call-parser hermes",
                              code="tool_call_parser_missing")
