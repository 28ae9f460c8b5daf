"""The target's Prometheus ``/metrics``, scraped before and after a measured phase.

What a phase records (``phase["server_metrics"]``):

- ``available``: False (with ``reason``) when the target has no ``/metrics`` or it is not
  Prometheus text; the rest is then absent, never guessed.
- ``deltas``: after - before of every counter sample (``name{label="v"}``) and of every
  histogram's and summary's ``_count`` and ``_sum`` (buckets left out: a phase's share of a
  histogram is its count and sum). Counters of several API servers are already summed by the
  server (prometheus_client's multiprocess mode), so one scrape sees them all.
- ``processor_cache``: the hits and misses of the server's processor (multimodal) cache that
  the phase caused: ``aphrodite_processor_cache_total{result=hit|miss}`` on this project's
  server, vLLM's ``vllm:mm_cache_hits`` / ``vllm:mm_cache_queries`` elsewhere.
- ``prefix_cache``: likewise for prompt tokens (``vllm:prefix_cache_hits`` /
  ``vllm:prefix_cache_queries``), when the target counts them.
- ``check``: the processor cache hit rate the server counted against the phase's claim (cold:
  no hits; warm: every lookup a hit): ``ok``, a warning sentence (also in the phase's
  ``warnings``; the run goes on: the server's counters include other clients' traffic), or
  None when the server counted no lookup.

Parsed with prometheus_client's own parser (the format has escapes, exemplars and
timestamps a regular expression would get wrong).
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp

from aphrodite_cli.bench.load.wire import request_headers

#: The processor cache's counters: (hits, lookups or misses, whether the second is misses).
_PROCESSOR_CACHE = (
    ('aphrodite_processor_cache_total{result="hit"}',
     'aphrodite_processor_cache_total{result="miss"}', True),
    ("vllm:mm_cache_hits_total", "vllm:mm_cache_queries_total", False),
)
_PREFIX_CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")

#: The largest /metrics body read (vLLM's is about 100 kB)
MAX_METRICS_BYTES = 32 << 20
#: A server counted hit rate this far from the claim (0 or 1) is a mismatch.
TOLERANCE = 0.01


def parse(text: str, gauges: bool = False) -> dict[str, float]:
    """Prometheus text -> {``name{labels}``: value} of the samples a delta means something
    for: counters (and untyped samples named ``*_total``), and histograms' and summaries'
    ``_count`` and ``_sum``; with ``gauges`` the gauges' samples as well (a value now, not a
    delta: memory in use, requests running)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "histogram", "summary", "gaugehistogram",
                               "unknown", "untyped", *(("gauge",) if gauges else ())):
            continue
        for sample in family.samples:
            if family.type in ("unknown", "untyped"):
                # untyped, or a "# TYPE x counter" line whose samples are x_total: a
                # counter by its name
                if not sample.name.endswith("_total"):
                    continue
            elif family.type not in ("counter", "gauge") and not sample.name.endswith(
                    ("_count", "_sum")):
                continue
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k != "model_name")  # vLLM's per-model label: one model here
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


async def scrape(root: str, api_key: str | None = None, timeout_s: float = 10.0,
                 extra_headers: dict[str, str] | None = None, gauges: bool = False
                 ) -> dict[str, float] | str:
    """``GET {root}/metrics`` parsed (see :func:`parse`), or why not (a sentence)."""
    headers = request_headers(api_key, extra_headers, json_body=False)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)
                                         ) as session, \
                session.get(f"{root}/metrics", headers=headers) as resp:
            if resp.status != 200:
                return f"GET /metrics answered HTTP {resp.status}"
            # a hostile target's endless /metrics: read up to the cap (--metrics-interval
            # scrapes it many times a phase)
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return f"GET /metrics is over {MAX_METRICS_BYTES} bytes"
            text = body.decode("utf-8", errors="replace")  # the format's encoding
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"GET /metrics failed ({type(exc).__name__})"
    try:
        samples = parse(text, gauges)
    except (ValueError, TypeError, IndexError) as exc:
        return f"GET /metrics is not Prometheus text ({type(exc).__name__})"
    if not samples:
        return "GET /metrics holds no counter"
    return samples


def _pair(deltas: dict[str, float], hits_key: str, other_key: str, other_is_misses: bool
          ) -> dict[str, Any] | None:
    if hits_key not in deltas and other_key not in deltas:
        return None
    hits = deltas.get(hits_key, 0.0)
    lookups = hits + deltas.get(other_key, 0.0) if other_is_misses else deltas.get(other_key,
                                                                                   0.0)
    return {"hits": hits, "misses": max(lookups - hits, 0.0),
            "hit_rate": hits / lookups if lookups > 0 else None, "counter": hits_key}


def phase_metrics(before: dict[str, float] | str, after: dict[str, float] | str,
                  mode: str) -> dict[str, Any]:
    """What one phase caused on the server, and the cache check for ``mode`` (cold, warm;
    any other mode claims nothing)."""
    if isinstance(before, str) or isinstance(after, str):
        return {"available": False, "reason": before if isinstance(before, str) else after}
    deltas = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    deltas = {k: round(v, 6) for k, v in deltas.items() if v and math.isfinite(v)}
    processor = next((p for spec in _PROCESSOR_CACHE if (p := _pair(deltas, *spec))), None)
    prefix = _pair(deltas, *_PREFIX_CACHE, False)
    check = None
    if processor is not None and processor["hit_rate"] is not None and mode in ("cold",
                                                                                 "warm"):
        want = 1.0 if mode == "warm" else 0.0
        rate = processor["hit_rate"]
        check = "ok" if abs(rate - want) <= TOLERANCE else (
            f"the server counted a processor cache hit rate of {rate:.0%} "
            f"({processor['hits']:g} hits, {processor['misses']:g} misses) in the {mode} "
            f"phase, which claims {'every lookup a hit' if mode == 'warm' else 'no hit'}")
    return {"available": True, "deltas": deltas, "processor_cache": processor,
            "prefix_cache": prefix, "check": check}
