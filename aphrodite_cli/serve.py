"""``aphrodite serve`` / ``aphrodite run``: the OpenAI-compatible multimodal server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from aphrodite_cli.config_flags import in_panel, option, with_config_flags
from aphrodite_cli.options import (
    AllowedLocalMediaPath,
    AllowedMediaDomains,
    MediaIoKwargs,
    parse_json_flag,
    split_hosts,
)
from aphrodite_cli.output import out
from engine.config import EngineConfig, ParallelConfig, PipelineConfig, VllmConfig
from engine.server.config import ServerConfig

MEDIA = PipelineConfig.PANEL
#: ``serve --help``'s panels, one per config class (the server's in four), in this order;
#: every option but those below is generated from its config field (engine/config.py,
#: engine/server/config.py: help, default and panel written there, the value checked when
#: the config is built)
PANELS = (ServerConfig.PANEL, "Requests", "Requests and connections", MEDIA,
          "Media fetch and decode", EngineConfig.PANEL, ParallelConfig.PANEL, VllmConfig.PANEL)

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


@with_config_flags(ServerConfig, PipelineConfig, EngineConfig, ParallelConfig, VllmConfig,
                   panels=PANELS)
def serve(
    model: Annotated[str | None, typer.Argument(
        help="Model folder, Hugging Face Hub id (downloaded into the Hugging Face cache when "
             "missing) or tiny:ARCH; default: the tiny Qwen2.5-VL.")] = None,
    chat_template: option(ServerConfig, "chat_template", Path | None) = None,
    api_key: option(ServerConfig, "api_key", list[str] | None) = None,
    trusted_proxies: option(ServerConfig, "trusted_proxies", str | None) = None,
    allowed_media_domains: in_panel(AllowedMediaDomains, MEDIA) = None,
    allowed_local_media_path: in_panel(AllowedLocalMediaPath, MEDIA) = None,
    limit_mm_per_prompt: option(PipelineConfig, "limit_mm_per_prompt", str | None) = None,
    mm_processor_kwargs: option(PipelineConfig, "mm_processor_kwargs", str | None) = None,
    media_io_kwargs: in_panel(MediaIoKwargs, MEDIA) = None,
    data_parallel_size: option(ParallelConfig, "data_parallel_size", str,
                               parser=parse_data_parallel) = ParallelConfig.data_parallel_size,
    kv_cache_memory_bytes: option(VllmConfig, "kv_cache_memory_bytes", str | None) = None,
    *, flags: dict[type, dict[str, Any]],
) -> None:
    """Serve a multimodal model with an OpenAI-compatible API (alias: aphrodite run)."""
    from engine import envs
    from engine.processing.pipeline import pipeline_config
    from engine.server.api.forwarded import TrustedProxies
    from engine.server.launcher import run
    from engine.server.vllm_adapter.vllm_spec import byte_count

    server = flags[ServerConfig]
    config = ServerConfig(
        model=model, chat_template=str(chat_template) if chat_template else None,
        api_key=tuple(api_key or ()) or ((envs.APHRODITE_API_KEY,)
                                         if envs.APHRODITE_API_KEY else None),
        **{**server,
           "admin_api_key": server["admin_api_key"] or envs.APHRODITE_ADMIN_API_KEY or None,
           "server_dev_mode": server["server_dev_mode"] or envs.APHRODITE_SERVER_DEV_MODE},
        trusted_proxies=tuple(p for p in (trusted_proxies or "").split(",") if p.strip())
        or None,
        # the request pipeline's settings, parsed and checked here once
        pipeline=pipeline_config(
            allowed_media_domains=tuple(split_hosts(allowed_media_domains)),
            allowed_local_media_path=str(allowed_local_media_path)
            if allowed_local_media_path else None,
            limit_mm_per_prompt=parse_json_flag("--limit-mm-per-prompt", limit_mm_per_prompt),
            mm_processor_kwargs=parse_json_flag("--mm-processor-kwargs", mm_processor_kwargs),
            media_io_kwargs=parse_json_flag("--media-io-kwargs", media_io_kwargs),
            request_kwargs="bounded", **flags[PipelineConfig]),
        # the engine's settings, checked here once and handed whole to the engine process
        engine=EngineConfig(**flags[EngineConfig]),
        parallel=ParallelConfig(data_parallel_size=data_parallel_size,
                                **flags[ParallelConfig]),
        vllm=VllmConfig(kv_cache_memory_bytes=byte_count("--kv-cache-memory-bytes",
                                                         kv_cache_memory_bytes)
                        if kv_cache_memory_bytes is not None else None,
                        **flags[VllmConfig]))
    TrustedProxies(config.trusted_proxies)  # a bad network is a flag error here, not at start
    code = run(config, announce=lambda msg: out.print(msg, markup=False))
    raise typer.Exit(code)
