"""``aphrodite serve`` / ``aphrodite run``: the OpenAI-compatible multimodal server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.options import (
    AllowedLocalMediaPath,
    AllowedMediaDomains,
    DecodeIsolation,
    MediaIoKwargs,
    ToolCallParser,
    parse_json_flag,
    split_hosts,
)
from aphrodite_cli.output import out
from engine.config import (
    MAX_OVERTAKES,
    EngineConfig,
    PipelineConfig,
    SchedulingPolicy,
    VllmConfig,
)
from engine.server.config import ServerConfig

EPILOG = """Examples:

  aphrodite serve                                   # the embedded tiny Qwen2.5-VL on :2242

  aphrodite serve /models/llava-1.5-7b-hf --chat-template engine/models/templates/llava.jinja

  aphrodite serve Qwen/Qwen2.5-VL-3B-Instruct        # downloaded into the HF cache

  aphrodite serve /models/Qwen2.5-VL-7B-Instruct
  --media-io-kwargs '{"video": {"backend": "torchcodec"}}'
  --limit-mm-per-prompt '{"image": 4, "video": 1}' --allowed-media-domains cdn.example.com

  aphrodite serve --api-key secret --api-server-count 2 --port 8000

  aphrodite serve Qwen/Qwen2.5-VL-72B-Instruct --engine vllm --tensor-parallel-size 8
  # vLLM's engine behind this front door (make setup-vllm builds its environment)"""


def parse_data_parallel(value: str | int) -> str | int:
    """``--data-parallel-size``: "auto" or a whole number of at least 1."""
    text = str(value).strip()
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise typer.BadParameter(f"{value!r} is not a whole number of at least 1 or auto, "
                                 "e.g. 2", param_hint="--data-parallel-size")
    return int(text)


def serve(
    model: Annotated[str | None, typer.Argument(
        help="Model folder, Hugging Face Hub id (downloaded into the Hugging Face cache when "
             "missing) or tiny:ARCH; default: the tiny Qwen2.5-VL.")] = None,
    revision: Annotated[str | None, typer.Option(
        help="Branch, tag or commit of a hub model, e.g. main.")] = ServerConfig.revision,
    download_dir: Annotated[str | None, typer.Option(
        help="Folder to download hub models into instead of the Hugging Face cache.")
    ] = ServerConfig.download_dir,
    host: Annotated[str, typer.Option(help="Address to listen on, e.g. 0.0.0.0.")
                    ] = ServerConfig.host,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port, e.g. 8000.")
    ] = ServerConfig.port,
    served_model_name: Annotated[str | None, typer.Option(
        help="Name clients use in 'model', e.g. my-vlm.")] = ServerConfig.served_model_name,
    chat_template: Annotated[Path | None, typer.Option(
        help="Jinja chat template file, e.g. engine/models/templates/llava.jinja.")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        help="Require 'Authorization: Bearer KEY' (or set APHRODITE_API_KEY); repeat it to "
             "accept several keys, e.g. --api-key team-a --api-key team-b.")
    ] = None,
    cache_salt_per_api_key: Annotated[bool, typer.Option(
        help="Salt each request's cached work by its API key (combined with any cache_salt "
             "it sends): the holders of different keys share no cached prompt tokens, "
             "processed media or media uuids. Needs --api-key.")
    ] = ServerConfig.cache_salt_per_api_key,
    admin_api_key: Annotated[str | None, typer.Option(
        help="Key of the admin routes (POST /reset_mm_cache, /reset_prefix_cache: they empty "
             "every client's caches), apart from --api-key (or set APHRODITE_ADMIN_API_KEY). "
             "Without it or --server-dev-mode those routes answer 404.")
    ] = ServerConfig.admin_api_key,
    server_dev_mode: Annotated[bool, typer.Option(
        help="Open the admin routes to --api-key holders (or anyone, without a key) with no "
             "admin key, as vLLM's VLLM_SERVER_DEV_MODE (or set APHRODITE_SERVER_DEV_MODE=1).")
    ] = ServerConfig.server_dev_mode,
    allowed_media_domains: AllowedMediaDomains = None,
    allowed_local_media_path: AllowedLocalMediaPath = None,
    limit_mm_per_prompt: Annotated[str | None, typer.Option(
        metavar="JSON", help='Items per prompt, e.g. \'{"image": 4, "video": 1}\'.')] = None,
    mm_processor_kwargs: Annotated[str | None, typer.Option(
        metavar="JSON", help='Processor settings, e.g. \'{"max_pixels": 802816}\'.')] = None,
    media_io_kwargs: MediaIoKwargs = None,
    mm_processor_cache_gb: Annotated[float, typer.Option(
        min=0, help="Processor cache size per API server in GB (0 disables), e.g. 4; with "
                    "--engine vllm, vLLM's processor cache (its flag).")
    ] = PipelineConfig.mm_processor_cache_gb,
    mm_uuid_cache_gb: Annotated[float, typer.Option(
        min=0, help="Media kept per client media uuid, per API server, in GB (0: none), e.g. "
                    "1: a content part may then send its uuid alone (\"image_url\": null) to "
                    "reuse media it sent before with that uuid.")
    ] = PipelineConfig.mm_uuid_cache_gb,
    mm_device_do_normalize: Annotated[bool, typer.Option(
        help="Rescale and normalize pixels on the model's device, not in the API server "
             "(vLLM's flag; Qwen2/2.5/3-VL): a quarter of the bytes through the cache and "
             "to the engine.")] = PipelineConfig.mm_device_do_normalize,
    mm_ipc_gpu_memory_gb: Annotated[float, typer.Option(
        min=0, help="GPU memory for video decoding, split among API servers, e.g. 4.")
    ] = ServerConfig.mm_ipc_gpu_memory_gb,
    api_server_count: Annotated[int, typer.Option(
        min=1, max=64, help="API server processes sharing the port, e.g. 2.")
    ] = ServerConfig.api_server_count,
    max_request_body_mb: Annotated[float, typer.Option(
        min=0.001, help="Largest request body in MB, e.g. 64.")] = ServerConfig.max_request_body_mb,
    request_body_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Seconds a client has to send its whole request body (else 408), "
                      "e.g. 30.")] = ServerConfig.request_body_timeout_s,
    header_read_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Seconds a new connection has to send its first request's headers "
                      "(else it is closed), e.g. 10.")
    ] = ServerConfig.header_read_timeout_s,
    keep_alive_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Seconds an idle connection stays open between requests, e.g. 15.")
    ] = ServerConfig.keep_alive_timeout_s,
    max_connections_per_client: Annotated[int, typer.Option(
        min=0, help="Open connections one client (its peer address) may hold per API server; "
                    "past it a new one replaces the client's oldest idle one (503 and close "
                    "when all are busy); 0: no per-client cap, e.g. 256.")
    ] = ServerConfig.max_connections_per_client,
    trusted_proxies: Annotated[str | None, typer.Option(
        help="Reverse proxies (addresses or CIDR networks, comma-separated, e.g. "
             "10.0.0.0/8,127.0.0.1) whose X-Forwarded-For names the client: per-client fetch "
             "and decode shares count the user behind the proxy. Connections still count "
             "peers.")] = None,
    max_prompt_bytes: Annotated[int | None, typer.Option(
        min=1, help="Most bytes of text in one request's messages or prompt, checked before "
                    "templating (400 prompt_too_long); default: what cannot fit "
                    "--max-model-len tokens.")] = ServerConfig.max_prompt_bytes,
    max_messages: Annotated[int | None, typer.Option(
        min=1, help="Most messages in one chat request, checked before templating (400 "
                    "too_many_messages); default: --max-model-len.")
    ] = ServerConfig.max_messages,
    metrics_without_auth: Annotated[bool, typer.Option(
        help="With --api-key, still serve /metrics without the key (for a scraper).")
    ] = ServerConfig.metrics_without_auth,
    expose_request_timings: Annotated[bool, typer.Option(
        help="Send each request's server-side stage timings and cache hits to its client "
             "(header x-aphrodite-timings, body field 'aphrodite'; bench serve reads them). "
             "Off by default: a cache hit tells a client that someone sent the same media.")
    ] = ServerConfig.expose_request_timings,
    process_file: Annotated[str | None, typer.Option(
        help="Write the server's process ids by role to this JSON file once it serves "
             "({\"supervisor\": PID, \"engines\": [...], \"api_servers\": [...]}), "
             "for tools that watch its processes; removed at exit.")
    ] = ServerConfig.process_file,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice",
        help="Let tool_choice \"auto\" (the default when a request sends tools) through: "
             "the calls the model writes are read by --tool-call-parser (vLLM's flags). "
             "Without it such a request is a 400; named and \"required\" tool choices need "
             "neither (the grammar engine forces the call).")
    ] = ServerConfig.enable_auto_tool_choice,
    tool_call_parser: Annotated[ToolCallParser | None, typer.Option(
        help="How the model writes its tool calls, for --enable-auto-tool-choice: hermes "
             "(<tool_call>{\"name\", \"arguments\"}</tool_call>, Qwen2.5's and Qwen3-VL's "
             "templates).")] = None,
    generation_config: Annotated[str, typer.Option(
        help="Request defaults for temperature, top_p, top_k, min_p, repetition_penalty and "
             "max_tokens (from max_new_tokens) when a request leaves them out (vLLM's flag): "
             "auto, the model's own generation_config.json; vllm, none (neutral defaults); "
             "or a folder holding a generation_config.json. The defaults in use are logged "
             "at start-up.")] = ServerConfig.generation_config,
    max_num_seqs: Annotated[int, typer.Option(
        help="Sequences in the running batch (a request's n counts n), e.g. 8: between "
             "decode steps finished ones leave and waiting ones join.")
    ] = EngineConfig.max_num_seqs,
    scheduling_policy: Annotated[SchedulingPolicy, typer.Option(
        help="Which waiting requests join the running batch first (vLLM's flag): fcfs, the "
             "oldest; priority, the lowest request 'priority' field (vLLM's; other values "
             "are refused under fcfs), then the oldest; shortest (ours), the fewest prompt "
             "tokens left to prefill after the prefix cache, so a video prompt does not hold "
             "up the image and text prompts that came after it. Under each a request "
             f"passed over {MAX_OVERTAKES} times goes first (priority's bound on waiting), "
             "and the sequences of one request (prompts x n) take turns with other "
             "requests'.")] = EngineConfig.scheduling_policy,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        help="Prompt tokens prefilled in one step when requests join the running "
             "batch, e.g. 8192 (a longer prompt is prefilled alone, a chunk per step); "
             "default: vLLM's, 2048 on a CPU and 8192 on a GPU.")
    ] = EngineConfig.max_num_batched_tokens,
    prefill_pass_tokens: Annotated[int | None, typer.Option(
        help="Most tokens (padding included) one prefill forward pass of several requests "
             "holds, e.g. 512; a step's requests beyond it go in further passes, and each "
             "pass sends its first tokens as it ends. Default: 256 on a CPU (a pass that "
             "size already runs at full speed), no bound on a GPU.")
    ] = EngineConfig.prefill_pass_tokens,
    num_threads: Annotated[int | None, typer.Option(
        help="torch threads of the engine process, e.g. 1 to match vLLM's CPU worker, "
             "which pins one core; default: the CPUs the process may use (its affinity and cgroup "
             "quota; torch's own default counts every core) over --data-parallel-size; 1 "
             "with --data-parallel-size auto on a model below 10 M parameters. "
             "API servers use "
             "APHRODITE_API_SERVER_TORCH_THREADS.")] = EngineConfig.num_threads,
    decode_threads: Annotated[int | None, typer.Option(
        help="torch threads of the decode steps, e.g. 1 (llama.cpp's --threads beside "
             "--threads-batch); prefills and encoders keep --num-threads. A decode step "
             "multiplies a few rows by every weight: on a small model and few cores more "
             "threads cost more than they save (the 43 M-parameter Qwen2.5-VL on 2 cores: "
             "--num-threads 2 --decode-threads 1 served 1.2-1.4x the cold requests/s of 1 or 2 "
             "threads throughout). Beside --overlap-prefill a prefill keeps --num-threads. "
             "Default: --num-threads.")
    ] = EngineConfig.decode_threads,
    overlap_prefill: Annotated[bool | None, typer.Option(
        help="Prefill the requests that join on a second thread while the running ones keep "
             "decoding (a CPU's matrix products run beside each other on two cores); "
             "default: on a CPU when --num-threads plus --decode-threads is at most the CPUs "
             "the process may use.")] = EngineConfig.overlap_prefill,
    enable_prefix_caching: Annotated[bool, typer.Option(
        help="Keep the keys and values of prompts' leading blocks (text, and media by their "
             "content) and reuse them for later prompts that start the same way (vLLM's "
             "flag and default).")] = EngineConfig.enable_prefix_caching,
    prefix_cache_gb: Annotated[float, typer.Option(
        help="Prefix cache size in GB, on the model's device, e.g. 4.")
    ] = EngineConfig.prefix_cache_gb,
    encoder_cache_gb: Annotated[float, typer.Option(
        help="Encoder output cache size in GB (0 disables), on the model's device: a media "
             "item seen before skips the encoder when its prefix misses, e.g. 1.")
    ] = EngineConfig.encoder_cache_gb,
    block_size: Annotated[int, typer.Option(
        help="Tokens per prefix-cache block (vLLM's flag): prompts share cached keys and "
             "values a whole block at a time, e.g. 16.")] = EngineConfig.block_size,
    max_model_len: Annotated[int, typer.Option(
        min=16, help="Prompt plus output tokens per request, e.g. 8192.")
    ] = ServerConfig.max_model_len,
    max_pending_requests: Annotated[int, typer.Option(
        min=1, help="Sequences in flight per API server before 503 + Retry-After (a "
                    "request counts prompts x n, at most half of this), e.g. 256.")
    ] = ServerConfig.max_pending_requests,
    decode_isolation: Annotated[DecodeIsolation, typer.Option(
        help="process (decode worker processes: a decoder crash, hang or memory blow-up "
             "fails one request, not the server) or thread (in the API server, faster by "
             "one hand-over through shared memory).")] = ServerConfig.decode_isolation,
    decode_workers: Annotated[int, typer.Option(
        min=1, help="Decode worker processes per API server with --decode-isolation process, "
                    "e.g. 4.")] = ServerConfig.decode_workers,
    decode_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Wall-clock limit of one isolated decode in seconds, e.g. 60.")
    ] = ServerConfig.decode_timeout_s,
    decode_cpu_budget_s: Annotated[float, typer.Option(
        min=0, help="CPU seconds (all threads) one isolated decode may use before it is "
                    "stopped with a 422, e.g. 30; 0: no budget. With --decode-isolation "
                    "thread: the decode's wall-clock seconds, checked between frames.")
    ] = ServerConfig.decode_cpu_budget_s,
    decode_memory_gb: Annotated[float, typer.Option(
        min=0.25, help="Address-space limit of one decode worker in GB, e.g. 8.")
    ] = ServerConfig.decode_memory_gb,
    max_concurrent_fetches: Annotated[int, typer.Option(
        min=1, help="http(s) media fetches in flight per API server (a request with http media "
                    "holds one while it fetches; data URLs and local files none), e.g. 16.")
    ] = ServerConfig.max_concurrent_fetches,
    max_fetches_per_client: Annotated[int, typer.Option(
        min=0, help="Of those, most held at once by one client (its peer address), so one "
                    "client's slow media hosts cannot hold them all; 0: no per-client share "
                    "(behind a reverse proxy every client has its address), e.g. 8.")
    ] = ServerConfig.max_fetches_per_client,
    max_decode_queue: Annotated[int, typer.Option(
        min=1, help="Requests fetching/decoding/preprocessing per API server before 503 + "
                    "Retry-After, e.g. 64.")] = ServerConfig.max_decode_queue,
    max_inflight_media_mb: Annotated[float, typer.Option(
        min=0.01, help="Fetched media bytes held per API server before 503 + Retry-After, in MB, "
                    "e.g. 2048.")] = ServerConfig.max_inflight_media_mb,
    engine_kind: Annotated[str, typer.Option(
        "--engine", help="aphrodite (this project's engine: one device, one process per "
                         "--data-parallel-size) or vllm "
                         "(vLLM's AsyncLLM in its own environment, .venv-vllm from `make "
                         "setup-vllm`: tensor/pipeline/data parallel, several nodes with Ray; "
                         "media still fetched and decoded here, processed by vLLM).")
    ] = ServerConfig.engine_kind,
    tensor_parallel_size: Annotated[int, typer.Option(
        help="--engine vllm: GPUs each model replica is split across, e.g. 8.")
    ] = VllmConfig.tensor_parallel_size,
    pipeline_parallel_size: Annotated[int, typer.Option(
        help="--engine vllm: pipeline stages (across nodes with Ray), e.g. 2.")
    ] = VllmConfig.pipeline_parallel_size,
    data_parallel_size: Annotated[str, typer.Option(
        metavar="N|auto", parser=parse_data_parallel,
        help="Model replicas, e.g. 2 (default 1), or auto: this project's engine decides "
             "from the model's parameters and the CPUs: below 10 M one engine on one thread, "
             "10-100 M an engine per core (at most 2) on one thread each, larger one engine "
             "on every CPU (measured in the README, 'Engines and threads by default'); "
             "--num-threads, if given, stays. A count: that many engine processes on "
             "this machine's CPUs, each with its own copy of the model and its own caches "
             "(N times the memory), each pinned to its own share of them with an even share of "
             "--num-threads by default; each request goes to one: where its first image (or its "
             "prompt's start) went before, while that one is at most 4 requests busier than "
             "another (each engine's prefix and encoder caches are its own), else the least "
             "busy. --engine vllm: "
             "vLLM's data parallel ranks.")] = VllmConfig.data_parallel_size,
    distributed_executor_backend: Annotated[str | None, typer.Option(
        help="--engine vllm: mp (one node) or ray (several nodes); default: vLLM's choice.")
    ] = VllmConfig.distributed_executor_backend,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="--engine vllm: fraction of each GPU vLLM plans for, e.g. 0.9; "
             "--mm-ipc-gpu-memory-gb comes out of it (out of the KV cache).")
    ] = VllmConfig.gpu_memory_utilization,
    kv_cache_memory_bytes: Annotated[str | None, typer.Option(
        metavar="SIZE",
        help="--engine vllm: vLLM's KV cache size (its flag; per GPU, or of the memory on a "
             "CPU), e.g. 4G (GiB) or 4g (GB). Default: from --gpu-memory-utilization on a "
             "GPU; 4G on a CPU, where vLLM would otherwise want 90% of the memory free to "
             "start (VLLM_CPU_KVCACHE_SPACE, when set, wins over both).")] = None,
    vllm_python: Annotated[str | None, typer.Option(
        help="--engine vllm: the Python of vLLM's environment; default .venv-vllm/bin/python.")
    ] = VllmConfig.python,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = EngineConfig.device,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")
    ] = EngineConfig.dtype,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", "-q",
        help="int8: the language model's linear weights as int8 rows with a scale each "
             "(weight-only, packed at load, dequantized in the product through PyTorch's "
             "int8 kernel with bfloat16 activations; a CPU device): a quarter of float32's "
             "weight bytes per decode step. Its speed and quality cost (greedy agreement, KL "
             "against float32): aphrodite bench decode-step --quantization int8. Default: "
             "off.")] = EngineConfig.quantization,
) -> None:
    """Serve a multimodal model with an OpenAI-compatible API (alias: aphrodite run)."""
    from engine import envs
    from engine.processing.pipeline import pipeline_config
    from engine.server.api.forwarded import TrustedProxies
    from engine.server.launcher import run
    from engine.server.vllm_adapter.vllm_spec import byte_count

    limits = parse_json_flag("--limit-mm-per-prompt", limit_mm_per_prompt)
    if enable_auto_tool_choice and tool_call_parser is None:
        from engine.errors import ConfigError

        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser",
                          hint="add --tool-call-parser hermes", code="tool_call_parser_missing")
    config = ServerConfig(
        model=model, revision=revision, download_dir=download_dir, host=host, port=port,
        served_model_name=served_model_name,
        chat_template=str(chat_template) if chat_template else None,
        api_key=tuple(api_key or ()) or ((envs.APHRODITE_API_KEY,)
                                         if envs.APHRODITE_API_KEY else None),
        cache_salt_per_api_key=cache_salt_per_api_key,
        admin_api_key=admin_api_key or envs.APHRODITE_ADMIN_API_KEY or None,
        server_dev_mode=server_dev_mode or envs.APHRODITE_SERVER_DEV_MODE,
        # the request pipeline's settings, parsed and checked here once
        pipeline=pipeline_config(
            allowed_media_domains=tuple(split_hosts(allowed_media_domains)),
            allowed_local_media_path=str(allowed_local_media_path)
            if allowed_local_media_path else None,
            limit_mm_per_prompt=limits,
            mm_processor_kwargs=parse_json_flag("--mm-processor-kwargs", mm_processor_kwargs),
            media_io_kwargs=parse_json_flag("--media-io-kwargs", media_io_kwargs),
            mm_processor_cache_gb=mm_processor_cache_gb, mm_uuid_cache_gb=mm_uuid_cache_gb,
            request_kwargs="bounded",
            mm_device_do_normalize=mm_device_do_normalize),
        mm_ipc_gpu_memory_gb=mm_ipc_gpu_memory_gb,
        api_server_count=api_server_count, max_request_body_mb=max_request_body_mb,
        request_body_timeout_s=request_body_timeout_s,
        header_read_timeout_s=header_read_timeout_s, keep_alive_timeout_s=keep_alive_timeout_s,
        max_connections_per_client=max_connections_per_client,
        trusted_proxies=tuple(p for p in (trusted_proxies or "").split(",") if p.strip())
        or None,
        max_prompt_bytes=max_prompt_bytes, max_messages=max_messages,
        metrics_without_auth=metrics_without_auth,
        expose_request_timings=expose_request_timings, process_file=process_file,
        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
        generation_config=generation_config,
        # the engine's settings, checked here once and handed whole to the engine process
        engine=EngineConfig(max_num_seqs=max_num_seqs, scheduling_policy=scheduling_policy,
                            max_num_batched_tokens=max_num_batched_tokens,
                            prefill_pass_tokens=prefill_pass_tokens,
                            num_threads=num_threads, decode_threads=decode_threads,
                            device=device, dtype=dtype, quantization=quantization,
                            overlap_prefill=overlap_prefill,
                            enable_prefix_caching=enable_prefix_caching,
                            prefix_cache_gb=prefix_cache_gb, encoder_cache_gb=encoder_cache_gb,
                            block_size=block_size),
        engine_kind=engine_kind,  # type: ignore[arg-type]  (checked by the launcher)
        vllm=VllmConfig(tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size,
                        data_parallel_size=data_parallel_size,
                        distributed_executor_backend=distributed_executor_backend,
                        gpu_memory_utilization=gpu_memory_utilization,
                        kv_cache_memory_bytes=byte_count("--kv-cache-memory-bytes",
                                                         kv_cache_memory_bytes)
                        if kv_cache_memory_bytes is not None else None,
                        python=vllm_python),
        max_model_len=max_model_len,
        max_pending_requests=max_pending_requests, decode_isolation=decode_isolation,
        decode_workers=decode_workers, decode_timeout_s=decode_timeout_s,
        decode_cpu_budget_s=decode_cpu_budget_s,
        decode_memory_gb=decode_memory_gb, max_decode_queue=max_decode_queue,
        max_concurrent_fetches=max_concurrent_fetches,
        max_fetches_per_client=max_fetches_per_client,
        max_inflight_media_mb=max_inflight_media_mb)
    TrustedProxies(config.trusted_proxies)  # a bad network is a flag error here, not at start
    code = run(config, announce=lambda msg: out.print(msg, markup=False))
    raise typer.Exit(code)
