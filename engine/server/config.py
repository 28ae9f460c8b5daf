"""Typed server configuration, built by the CLI from flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None
    revision: str | None = None  # of a Hugging Face Hub model
    download_dir: str | None = None  # where hub models go (default: the Hugging Face cache)
    host: str = "127.0.0.1"
    port: int = 2242
    served_model_name: str | None = None
    chat_template: str | None = None
    api_key: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4.0
    mm_ipc_gpu_memory_gb: float = 0.0
    api_server_count: int = 1
    max_request_body_mb: float = 64.0
    request_body_timeout_s: float = 30.0
    metrics_without_auth: bool = False
    expose_request_timings: bool = False
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # prompt tokens prefilled per step; None: no cap
    num_threads: int | None = None  # torch threads of the engine process; None: torch's default
    max_model_len: int = 8192
    max_tokens_cap: int = 4096
    max_concurrent_fetches: int = 16
    max_fetches_per_client: int = 8  # 0: no per-client share
    max_pending_requests: int = 256
    decode_isolation: str = "process"  # decode worker processes; or "thread" (in-process)
    decode_workers: int = 2
    decode_timeout_s: float = 60.0
    decode_memory_gb: float = 8.0
    max_decode_queue: int = 64
    max_inflight_media_mb: float = 2048.0
    device: str = "cpu"
    dtype: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def pipeline_config(self):  # -> engine.processing.pipeline.PipelineConfig
        """The request pipeline's part of the flags; clients may set only the bounded
        processor kwargs per request."""
        from engine.processing.pipeline import PipelineConfig

        return PipelineConfig(
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            mm_processor_kwargs=self.mm_processor_kwargs,
            mm_processor_cache_gb=self.mm_processor_cache_gb,
            media_io_kwargs=self.media_io_kwargs,
            allowed_media_domains=tuple(self.allowed_media_domains),
            allowed_local_media_path=self.allowed_local_media_path, request_kwargs="bounded")
