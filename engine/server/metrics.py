"""Prometheus metrics of one API server process (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine.memory import heap_stats

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # python_gc_objects_collected_total: objects freed only by the cyclic collector, i.e.
        # held in reference cycles; a count that grows with requests is a leak smell.
        GCCollector(registry=self.registry)
        # glibc's heap: bytes in live blocks vs free but kept (this process's allocator keeps
        # freed frame memory on purpose, see engine.memory): a leak raises the first; a new
        # high-water mark only the second and RSS.
        Gauge("aphrodite_heap_in_use_bytes", "glibc heap bytes in live blocks (incl. mmapped)",
              registry=self.registry).set_function(
            lambda: (heap_stats() or {}).get("live", 0))
        Gauge("aphrodite_heap_free_bytes", "glibc heap bytes freed but kept by the allocator",
              registry=self.registry).set_function(lambda: (heap_stats() or {}).get("free", 0))
        # process_resident_memory_bytes, process_open_fds, ... of this API server
        ProcessCollector(registry=self.registry)
        self.engine = {name: Gauge(f"aphrodite_engine_{name}", help_, registry=self.registry)
                       for name, help_ in (
            ("rss_bytes", "Resident memory of the engine process"),
            ("heap_in_use_bytes", "glibc heap bytes in live blocks in the engine process"),
            ("heap_free_bytes", "glibc heap bytes freed but kept in the engine process"),
            ("gc_objects_collected", "Objects the engine's cyclic garbage collector freed"),
            ("requests_in_flight", "Requests in the engine from this API server"),
            ("num_rows_running", "Sequences (rows; a request's n counts n) in the running "
                                 "batch"),
            ("num_rows_waiting", "Sequences waiting for a place in the running batch"),
            ("steps_total", "Decode steps the engine has run"),
            ("prefill_tokens_total", "Prompt tokens prefilled"),
            ("decode_tokens_total", "Tokens decoded (one per row per step)"),
            ("batch_size_last", "Rows in the last decode step"),
            ("batch_size_max", "Most rows in one decode step so far"))}
        self.engine_up = Gauge("aphrodite_engine_stats_up",
                               "1 when the engine answered this scrape's stats request in "
                               "time, 0 when its numbers above are unknown (NaN)",
                               registry=self.registry)
        self.requests = Counter("aphrodite_requests_total", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.stream_errors = Counter("aphrodite_stream_errors_total",
                                     "Streams ended by an error event after their headers, by "
                                     "the error's status", ["status"], registry=self.registry)
        self.stage = Histogram("aphrodite_stage_seconds", "Per-request time in each stage",
                               ["stage"], buckets=_BUCKETS, registry=self.registry)
        self.cache = Counter("aphrodite_processor_cache_total", "Processor cache lookups",
                             ["result"], registry=self.registry)
        self.media_bytes = Counter("aphrodite_media_bytes_fetched_total",
                                   "Media bytes fetched, by modality", ["modality"],
                                   registry=self.registry)
        self.video_decode = Histogram("aphrodite_video_decode_seconds",
                                      "Video decode time by backend", ["backend"],
                                      buckets=_BUCKETS, registry=self.registry)
        self.gpu_budget = Gauge("aphrodite_gpu_decode_budget_bytes_in_use",
                                "GPU decode budget held by this API server",
                                registry=self.registry)

        self.inflight_bytes = Gauge("aphrodite_media_bytes_in_flight",
                                    "Fetched media bytes held by requests not yet preprocessed",
                                    registry=self.registry)
        self.decode_restarts = Gauge("aphrodite_decode_worker_restarts",
                                     "Decode workers killed (crash, timeout) and replaced",
                                     registry=self.registry)

        # vLLM's names, so dashboards built for vLLM read this server too (labelled with
        # model_name like vLLM's). TTFT and E2E are the server's view: from the request body
        # read to the first token / the last.
        latency = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds",
                                   "Time to first token (server side)", ["model_name"],
                                   buckets=latency, registry=self.registry)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds",
                                  "End-to-end request latency (server side)", ["model_name"],
                                  buckets=latency, registry=self.registry)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds",
                                   "Time per output token after the first", ["model_name"],
                                   buckets=latency, registry=self.registry)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed",
                                          ["model_name"], registry=self.registry)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                              ["model_name"], registry=self.registry)
        self.vllm_running = Gauge("vllm:num_requests_running",
                                  "Requests of this API server in the engine", ["model_name"],
                                  registry=self.registry)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting",
                                  "Requests of this API server admitted but not yet in the "
                                  "engine (fetching, decoding, preprocessing)", ["model_name"],
                                  registry=self.registry)

    def observe_request(self, model: str, *, e2e_s: float, decode_s: float, prompt: int,
                        generated: int) -> None:
        """One finished request in vLLM's metrics."""
        self.vllm_e2e.labels(model).observe(e2e_s)
        self.vllm_ttft.labels(model).observe(max(e2e_s - decode_s, 0.0))
        if generated > 1:
            self.vllm_tpot.labels(model).observe(decode_s / (generated - 1))
        self.vllm_prompt_tokens.labels(model).inc(prompt)
        self.vllm_generation_tokens.labels(model).inc(generated)

    def set_engine(self, stats: dict[str, float] | None) -> None:
        """The engine process's numbers, fetched over its socket at scrape time; ``None``
        (it did not answer in time) makes them NaN, never the last scrape's numbers."""
        self.engine_up.set(0 if stats is None else 1)
        for name, gauge in self.engine.items():
            gauge.set(float("nan") if stats is None else stats.get(name, float("nan")))

    def render(self) -> bytes:
        return generate_latest(self.registry)
