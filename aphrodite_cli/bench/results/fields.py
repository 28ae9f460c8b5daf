"""Names that result files use, shared by their writers (``load/``) and their readers (the
report, the console): written once here, below both.

- :func:`stage_ms`: a server stage's field where it holds milliseconds (``decode_ms``);
- :data:`SERIES`: the telemetry series a serve result holds (``--metrics-interval``), each
  with the Prometheus names it is read from; :data:`COUNTERS`: those that are running totals;
- :func:`label`: a ``bench sweep serve`` parameter set's name (``max_num_seqs=8``).
"""

from __future__ import annotations

import json
from typing import Any


def stage_ms(name: str) -> str:
    """A server stage's name in results, where it holds milliseconds: ``decode_s`` (the
    server's timing, in seconds) -> ``decode_ms``."""
    return name.removesuffix("_s") + "_ms"


#: series name -> the Prometheus names that hold it, the first exported wins
SERIES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "engine_rows_running": ("aphrodite_engine_num_rows_running",),
    "engine_rows_waiting": ("aphrodite_engine_num_rows_waiting",),
    "prefix_cache_bytes": ("aphrodite_engine_prefix_cache_bytes",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
    "mm_cache_queries": ("vllm:mm_cache_queries_total",),
    "mm_cache_hits": ("vllm:mm_cache_hits_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "num_preemptions": ("vllm:num_preemptions_total",),
}
#: the series that are running totals (the others are gauges: a value at the time)
COUNTERS = frozenset(s for s, names in SERIES.items() if names[0].endswith("_total"))


def label(params: dict[str, Any]) -> str:
    """``max_num_seqs=8,num_prompts=4`` (``-`` for the empty set): names a combination."""
    return ",".join(f"{k}={v if not isinstance(v, dict | list) else json.dumps(v)}"
                    for k, v in params.items()) or "-"
