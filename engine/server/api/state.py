"""What one API server process holds for its handlers, built once: the model and its
pipeline, the engine client, limits, fetch slots, metrics, decoders.

Its own module so that the app and the request steps it calls (:mod:`~engine.server.api.prepare`,
:mod:`~engine.server.api.reply`, :mod:`~engine.server.api.respond`) all import it from below:
none of them imports the app.
"""

from __future__ import annotations

import threading
from typing import Any

from engine.executor.grammar import Grammars, logits_vocab
from engine.media.inflight import InflightBytes
from engine.media.video.budget import GpuDecodeBudget
from engine.models.loader import LoadedModel
from engine.processing.media_items import InProcessDecoders
from engine.processing.pipeline import Pipeline
from engine.server.api.fetch_slots import FetchSlots
from engine.server.api.forwarded import TrustedProxies
from engine.server.api.logprobs import TokenStrings
from engine.server.api.metrics import Metrics
from engine.server.api.text_limits import TextLimits
from engine.server.config import ServerConfig
from engine.server.process.engine_client import EngineClient


class State:
    """Everything a handler needs, built once per API server process."""

    def __init__(self, config: ServerConfig, loaded: LoadedModel, engine: EngineClient,
                 backend: Any) -> None:
        self.config = config
        self.loaded = loaded
        self.engine = engine
        #: what differs by --engine, chosen once (engine.server.api.backend)
        self.backend = backend
        self.name = config.served_model_name or loaded.name
        self.pipeline = Pipeline(loaded, config.pipeline)
        self.preprocessor = self.pipeline.preprocessor
        #: --engine vllm: the items vLLM's processor cache holds, by this server's account
        #: (its share of that cache, --mm-processor-cache-gb; see
        #: engine.server.vllm_adapter.vllm_media)
        self.vllm_ledger = backend.ledger(config)
        self.token_strings = TokenStrings(loaded.tokenizer)
        #: token ids a prompt may hold: the tokenizer's and the model's vocabulary
        self.vocab_size = min(len(loaded.tokenizer), loaded.config.get("vocab_size") or (
            loaded.config.get("text_config") or {}).get("vocab_size") or 1 << 62)
        self.media_limits = self.pipeline.media_limits
        #: compiled structured-output constraints (made on the first request with one)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.text_limits = TextLimits.derive(loaded.tokenizer, config.max_model_len,
                                             config.max_prompt_bytes, config.max_messages)
        self.connector = self.pipeline.connector()
        self.fetch_slots = FetchSlots(config.max_concurrent_fetches,
                                      config.max_fetches_per_client)
        self.trusted_proxies = TrustedProxies(config.trusted_proxies)
        self.metrics = Metrics(model_name=self.name)
        self.pending = 0
        # in this process's threads, checked between frames against the same budget
        self.decoders: Any = InProcessDecoders(config.decode_cpu_budget_s)
        if config.decode_isolation == "process":
            from engine.media.isolation import DecodeWorkers

            self.decoders = DecodeWorkers(
                config.decode_workers, timeout_s=config.decode_timeout_s,
                memory_limit_bytes=int(config.decode_memory_gb * (1 << 30)),
                max_waiting=config.max_decode_queue, cpu_budget_s=config.decode_cpu_budget_s)
        self.inflight = InflightBytes(int(config.max_inflight_media_mb * (1 << 20)))
        self.preprocessing = 0  # requests fetching, decoding or in the HF processor
        self.metrics.sample(self.metrics.inflight_bytes, lambda: self.inflight.in_use)
        decoders = self.decoders
        if not isinstance(decoders, InProcessDecoders):  # workers restart; threads do not
            self.metrics.follow(self.metrics.decode_restarts, lambda: decoders.restarts)
        self.count()
        routed = getattr(engine, "routed", None)  # data-parallel engines (EnginePool)
        for index in range(len(routed or ())):
            self.metrics.follow(self.metrics.engine_routed.labels(engine=str(index)),
                                lambda index=index: routed[index])  # type: ignore[index]
        # This process's share of --mm-ipc-gpu-memory-gb, for GPU video backends.
        self.gpu_budget = (GpuDecodeBudget.from_gb(config.mm_ipc_gpu_memory_gb,
                                                   config.api_server_count)
                           if config.mm_ipc_gpu_memory_gb > 0 else None)

    def grammars(self) -> Grammars:
        """This process's compiled constraints for the model's tokenizer (xgrammar imported
        on the first call: call it off the event loop)."""
        with self._grammars_lock:
            if self._grammars is None:
                tokenizer = self.loaded.tokenizer
                self._grammars = Grammars(tokenizer, logits_vocab(self.loaded.config,
                                                                  tokenizer),
                                          [tokenizer.eos_token_id]
                                          if tokenizer.eos_token_id is not None else [])
            return self._grammars

    def count(self, *, pending: int = 0, preprocessing: int = 0) -> None:
        """Requests in flight / preprocessing change here, and vLLM's running and waiting
        gauges with them (written at once: a sibling API server's scrape reads them)."""
        self.pending += pending
        self.preprocessing += preprocessing
        self.metrics.vllm_waiting.labels(self.name).set(self.preprocessing)
        self.metrics.vllm_running.labels(self.name).set(max(self.pending - self.preprocessing,
                                                            0))
