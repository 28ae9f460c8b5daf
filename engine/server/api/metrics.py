"""Prometheus metrics of the API server processes (``GET /metrics``).

One API server: a plain registry. Several (``--api-server-count N``): prometheus_client's
multiprocess mode. The supervisor gives every API server one folder (``PROMETHEUS_MULTIPROC_DIR``,
set before prometheus_client is imported), each process writes its values there, and a scrape,
whichever process the kernel hands it to, reads them all: counters and histograms are sums over
the processes, per-process gauges are sums over the live ones, the engine's numbers are the
most recent any process fetched. A per-process collector (CPU, open files, GC) cannot be summed
and is left out in that mode; the API servers' summed RSS and heap stay.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)

from engine.memory import heap_stats, rss_bytes

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


# How often each API server writes its sampled gauges in multiprocess mode (the scraped
# process writes its own at the scrape): a sibling's gauge is at most this old.
REFRESH_S = 1.0


def multiprocess_dir() -> str | None:
    """The folder of multiprocess mode when this process is in it."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        #: the served model's name: vLLM's metrics carry it as their model_name label
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        if self.multiprocess and values.ValueClass is values.MutexValue:
            raise RuntimeError("PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was "
                               "imported; set it before (see engine.server.api.serve)")
        # Gauges read from a function: set at each scrape (and every REFRESH_S in
        # multiprocess mode, where a function gauge would not reach the shared files).
        self._sampled: list[tuple[Gauge, Callable[[], float]]] = []
        # Counters fed from a running count kept elsewhere: (counter, read, last seen).
        self._followed: list[list] = []
        if not self.multiprocess:
            # python_gc_objects_collected_total: objects freed only by the cyclic collector,
            # i.e. held in reference cycles; a count that grows with requests is a leak smell.
            GCCollector(registry=self.registry)
            # process_resident_memory_bytes, process_open_fds, ... of this API server
            ProcessCollector(registry=self.registry)
        # glibc's heap: bytes in live blocks vs free but kept (this process's allocator keeps
        # freed frame memory on purpose, see engine.memory): a leak raises the first; a new
        # high-water mark only the second and RSS.
        self.sample(self.gauge("aphrodite_heap_in_use_bytes",
                               "glibc heap bytes in live blocks (incl. mmapped) of the API "
                               "server(s)"), lambda: (heap_stats() or {}).get("live", 0))
        self.sample(self.gauge("aphrodite_heap_free_bytes",
                               "glibc heap bytes freed but kept by the API servers' allocator"),
                    lambda: (heap_stats() or {}).get("free", 0))
        self.sample(self.gauge("aphrodite_api_server_rss_bytes",
                               "Resident memory of the API server process(es)"),
                    lambda: rss_bytes() or 0)
        self.engine = {name: self.gauge(f"aphrodite_engine_{name}", help_, mode="mostrecent")
                       for name, help_ in (
            ("rss_bytes", "Resident memory of the engine process"),
            ("heap_in_use_bytes", "glibc heap bytes in live blocks in the engine process"),
            ("heap_free_bytes", "glibc heap bytes freed but kept in the engine process"),
            ("gc_objects_collected", "Objects the engine's cyclic garbage collector freed"),
            ("requests_in_flight", "Requests in the engine (from every API server)"),
            ("num_rows_running", "Sequences (rows; a request's n counts n) in the running "
                                 "batch"),
            ("num_rows_waiting", "Sequences waiting for a place in the running batch"),
            ("steps_total", "Decode steps the engine has run"),
            ("prefill_tokens_total", "Prompt tokens prefilled"),
            ("prefills_overlapped_total", "Prefills run beside decode steps on the prefill "
                                          "thread (--overlap-prefill)"),
            ("decode_tokens_total", "Tokens decoded (one per row per step)"),
            ("batch_size_last", "Rows in the last decode step"),
            ("batch_size_max", "Most rows in one decode step so far"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("prefix_cache_bytes", "Bytes of keys and values the prefix cache holds"),
            ("encoder_cache_hits", "Media items whose encoder output came from the encoder "
                                   "cache"),
            ("encoder_cache_misses", "Media items the encoder ran on (encoder cache on)"),
            ("encoder_cache_bytes", "Bytes of encoder outputs the encoder cache holds"))}
        self.engine_up = self.gauge("aphrodite_engine_stats_up",
                                    "1 when the engine answered this scrape's stats request in "
                                    "time, 0 when its numbers above are unknown (NaN)",
                                    mode="mostrecent")
        self.engine_routed = Counter(
            "aphrodite_engine_requests_routed_total", "Requests sent to each data-parallel "
            "engine (--data-parallel-size; engine: its index)", ["engine"],
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
        self.vllm_media_resent = Counter(
            "aphrodite_vllm_media_resent", "--engine vllm: requests sent again with their "
            "media's data, vLLM no longer holding an item this server left out",
            registry=self.registry)
        self.media_bytes = Counter("aphrodite_media_bytes_fetched_total",
                                   "Media bytes fetched, by modality", ["modality"],
                                   registry=self.registry)
        self.video_decode = Histogram("aphrodite_video_decode_seconds",
                                      "Video decode time by backend", ["backend"],
                                      buckets=_BUCKETS, registry=self.registry)
        self.gpu_budget = self.gauge("aphrodite_gpu_decode_budget_bytes_in_use",
                                     "GPU decode budget held by the API server(s)")
        self.inflight_bytes = self.gauge("aphrodite_media_bytes_in_flight",
                                         "Fetched media bytes held by requests not yet "
                                         "preprocessed")
        # exposed as aphrodite_decode_worker_restarts_total
        self.decode_restarts = Counter("aphrodite_decode_worker_restarts",
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
        # counted per finished request here (a sum over API servers stays right); the
        # engine's own running counts are the aphrodite_engine_prefix_cache_* gauges
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache",
                                           ["model_name"], registry=self.registry)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits",
                                        "Prompt tokens found in the prefix cache",
                                        ["model_name"], registry=self.registry)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds",
                                  "Time between a sequence's consecutive tokens, as the API "
                                  "server receives them", ["model_name"], buckets=latency,
                                  registry=self.registry)
        self.vllm_queue = Histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited in the engine before its prefill",
                                    ["model_name"], buckets=latency, registry=self.registry)
        self.vllm_mm_queries = Counter("vllm:mm_cache_queries",
                                       "Media items looked up in the processor cache",
                                       ["model_name"], registry=self.registry)
        self.vllm_mm_hits = Counter("vllm:mm_cache_hits",
                                    "Media items found in the processor cache", ["model_name"],
                                    registry=self.registry)
        # this engine's KV grows on demand and a running sequence is never preempted: the
        # counter exists for vLLM's dashboards and stays 0
        self.vllm_preemptions = Counter("vllm:num_preemptions", "Sequences preempted "
                                        "(never, in this engine)", ["model_name"],
                                        registry=self.registry)
        if model_name:  # (a labelled counter shows only once its label is used)
            self.vllm_preemptions.labels(model_name)
        # vLLM's: the fraction (0 to 1) of the KV cache space in use. This engine keeps no
        # fixed pool for the running sequences (their KV grows on demand, never preempted);
        # its bounded KV space is the prefix cache: bytes of blocks held over
        # --prefix-cache-gb (NaN when the engine did not answer, or keeps no prefix cache)
        self.vllm_kv_usage = self.gauge("vllm:kv_cache_usage_perc",
                                        "Fraction of the prefix cache's KV space held "
                                        "(--prefix-cache-gb), 0 to 1", ["model_name"],
                                        mode="mostrecent")
        self.vllm_running = self.gauge("vllm:num_requests_running",
                                       "Requests of the API server(s) in the engine",
                                       ["model_name"])
        self.vllm_waiting = self.gauge("vllm:num_requests_waiting",
                                       "Requests of the API server(s) admitted but not yet in "
                                       "the engine (fetching, decoding, preprocessing)",
                                       ["model_name"])

    def gauge(self, name: str, help_: str, labels: tuple[str, ...] | list[str] = (), *,
              mode: str = "livesum") -> Gauge:
        """A gauge; in multiprocess mode ``mode`` says how the processes' values combine
        (a per-process state: summed over the live ones; the engine's: the latest)."""
        return Gauge(name, help_, list(labels), registry=self.registry,
                     multiprocess_mode=mode)  # type: ignore[arg-type]

    def sample(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Set ``gauge`` from ``read()`` at each scrape (and every REFRESH_S)."""
        self._sampled.append((gauge, read))

    def follow(self, counter: Counter, read: Callable[[], int]) -> None:
        """Keep ``counter`` equal to the running count ``read()`` (which only grows)."""
        self._followed.append([counter, read, 0])

    def refresh(self) -> None:
        """Write the sampled gauges and followed counters of this process."""
        for gauge, read in self._sampled:
            gauge.set(read())
        for entry in self._followed:
            counter, read, seen = entry
            now = read()
            if now > seen:
                counter.inc(now - seen)
                entry[2] = now

    def count_items(self, hits: list[bool]) -> None:
        """A request's media items in ``aphrodite_processor_cache_total`` (found or not) and
        in vLLM's ``mm_cache_queries``/``mm_cache_hits``."""
        for hit in hits:
            self.cache.labels("hit" if hit else "miss").inc()
        if hits and self.model_name:
            self.vllm_mm_queries.labels(self.model_name).inc(len(hits))
            self.vllm_mm_hits.labels(self.model_name).inc(sum(hits))

    def observe_request(self, model: str, *, e2e_s: float, decode_s: float, prompt: int,
                        generated: int, cached: int = 0, queue_s: float | None = None) -> None:
        """One finished request in vLLM's metrics (``cached``: its prompt tokens from the
        prefix cache; ``queue_s``: its wait in the engine, when the engine timed it)."""
        if queue_s is not None:
            self.vllm_queue.labels(model).observe(queue_s)
        self.vllm_prefix_queries.labels(model).inc(prompt)
        self.vllm_prefix_hits.labels(model).inc(cached)
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
        if self.model_name:  # (over every data-parallel engine's caches together)
            capacity = (stats or {}).get("prefix_cache_capacity_bytes", 0.0)
            self.vllm_kv_usage.labels(self.model_name).set(
                stats["prefix_cache_bytes"] / capacity if stats and capacity > 0
                else float("nan"))
        for name, gauge in self.engine.items():
            gauge.set(float("nan") if stats is None else stats.get(name, float("nan")))

    def render(self) -> bytes:
        self.refresh()
        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
