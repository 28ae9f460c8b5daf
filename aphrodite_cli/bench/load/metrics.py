"""Serving metrics, with their formulas written down once (also stored in every result).

Per request (streaming):
- TTFT = time of the first content chunk - time the request was sent.
- ITL = every gap between consecutive content chunks (pooled over requests).
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
  the first token is excluded.
- E2E = time the stream ended - time the request was sent.
- TTST (time to second token, AIPerf's ``time_to_second_token``) = the second content chunk's
  time - the first's: the first ITL gap, the wait for decoding to start after prefill.
- Output tokens per second per user (AIPerf's ``output_token_throughput_per_user``) =
  (output tokens - 1) / (E2E - TTFT) = 1 / TPOT: the reading speed one user sees.
A request the benchmark cancels itself (--request-cancellation-rate) is neither completed
nor failed: it is counted as cancelled and has no latency sample.
Run level: request throughput = completed requests / benchmark duration; output token
throughput = output tokens of completed requests / duration; input token throughput (SGLang's and
AIPerf's ``input_token_throughput``) = the server's prompt tokens (``usage.prompt_tokens``) of
completed requests / duration; total token throughput (vLLM's ``total_token_throughput``) =
(input + output tokens) / duration; both None when a completed request's server reported no
usage (its prompt tokens are unknown); goodput = completed requests
meeting every SLO given with --goodput (e.g. ttft:200,tpot:50 in ms) / duration.
Percentiles interpolate linearly between closest ranks (see stats.percentile).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aphrodite_cli.bench.results.fields import stage_ms
from aphrodite_cli.bench.results.stats import percentile, summary

FORMULAS = {
    "ttft": "first content chunk time - send time",
    "itl": "gap between consecutive content chunks, pooled over requests",
    "tpot": "(e2e - ttft) / (output_tokens - 1), requests with >1 output token",
    "e2e": "stream end time - send time",
    "request_throughput": "completed requests / duration",
    "output_throughput": "completed output tokens / duration",
    "input_token_throughput": "completed requests' usage.prompt_tokens / duration (None "
                              "without usage)",
    "total_token_throughput": "(input + output tokens of completed requests) / duration",
    "ttst": "second content chunk time - first content chunk time",
    "output_token_throughput_per_user": "(output_tokens - 1) / (e2e - ttft) = 1 / tpot, "
                                        "tokens/s, requests with >1 output token",
    "goodput": "completed requests meeting all SLOs / duration",
    "percentiles": "linear interpolation between closest ranks",
}


@dataclass
class RequestRecord:
    """What the load generator saw for one request."""

    index: int
    ok: bool = False
    #: cut by the benchmark itself (--request-cancellation-rate): neither ok nor failed
    cancelled: bool = False
    error: str | None = None
    status: int | None = None  # HTTP status of the answer; None: no answer
    error_body: str | None = None  # the start of a failed answer's body, as sent
    # where output_tokens came from: the server's "usage", the client's "tokenizer"
    # (--tokenizer), or "stream chunks" counted one token each (an estimate)
    token_source: str = "stream chunks"
    text: list[str] = field(default_factory=list)  # the streamed pieces (for --tokenizer)
    sent_at: float = 0.0
    ttft: float | None = None
    #: the last finish reason the answer gave (a complete answer with none and no token fails)
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    #: of them, what the target's prefix cache supplied (usage.prompt_tokens_details)
    cached_tokens: int = 0
    request_bytes: int = 0
    encode_s: float = 0.0
    server: dict[str, Any] | None = None
    # the answer's usage.prompt_tokens_details (cached, image, video, audio tokens), if any
    prompt_details: dict[str, Any] | None = None

    @property
    def usage_reported(self) -> bool:
        return self.token_source == "usage"

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def ttst(self) -> float | None:
        """Time to second token: the first gap between content chunks."""
        return self.itl[0] if self.ok and self.itl else None

    @property
    def tokens_per_s_per_user(self) -> float | None:
        """Output tokens per second this request's user saw after the first: 1 / TPOT."""
        tpot = self.tpot
        return 1.0 / tpot if tpot else None


def _stats(values: list[float]) -> dict[str, float]:
    out = summary(values)
    if values:
        out["p50"] = out["median"]
        out["p95"] = percentile(values, 95)
    return out


def _ms(values: list[float]) -> dict[str, float]:
    return _stats([v * 1000 for v in values])


def compute(records: list[RequestRecord], duration_s: float,
            slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """Every metric of a run from its request records."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and not r.cancelled]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [t for r in done if (t := r.tpot) is not None]
    itl = [gap for r in done for gap in r.itl]
    e2e = [r.e2e for r in done if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in done)
    # prompt tokens as the server counted them: known when every completed answer said
    in_tokens = (sum(r.prompt_tokens for r in done)
                 if done and all(r.usage_reported for r in done) else None)
    slos = slos_ms or {}

    def good(r: RequestRecord) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
        return all(values.get(k) is not None and values[k] * 1000 <= v for k, v in slos.items())

    stages: dict[str, list[float]] = {}
    hits = misses = 0
    for r in done:
        if not r.server:
            continue
        for key, value in (r.server.get("timings") or {}).items():
            if key.endswith("_s") and isinstance(value, int | float):
                stages.setdefault(stage_ms(key), []).append(float(value))
        for hit in r.server.get("cache_hits") or []:
            hits, misses = hits + bool(hit), misses + (not hit)
    return {
        "completed": len(done), "failed": len(failed),
        # closed by the benchmark (--request-cancellation-rate): neither completed nor failed
        "cancelled": len(records) - len(done) - len(failed),
        # completed with 0 output tokens (the model ended at once): no TTFT sample
        "empty_answers": sum(1 for r in done if r.ttft is None),
        "failures_by_type": dict(Counter(r.error or "unknown" for r in failed)),
        # one answer body per failure type, as the target sent it (what to fix, at a glance)
        "failure_examples": {r.error or "unknown": r.error_body for r in reversed(failed)
                             if r.error_body},
        # the server's usage, the client's tokenizer, or stream chunks counted one token
        # each (an estimate: a chunk may hold several tokens); several when they differ
        "output_tokens_from": " + ".join(sorted({r.token_source for r in done})) or None,
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "input_token_throughput": in_tokens / duration_s if duration_s and in_tokens is not
        None else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s and
        in_tokens is not None else None,
        "goodput": (sum(1 for r in done if good(r)) / duration_s if duration_s else 0.0)
        if slos else None,
        "slos_ms": slos or None,
        "ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot), "itl_ms": _ms(itl), "e2e_ms": _ms(e2e),
        "ttst_ms": _ms([t for r in done if (t := r.ttst) is not None]),
        "output_token_throughput_per_user": _stats(
            [v for r in done if (v := r.tokens_per_s_per_user) is not None]),
        "client": {"request_bytes": summary([r.request_bytes for r in records]),
                   "encode_ms": _ms([r.encode_s for r in records])},
        "server_stages_ms": {k: _ms(v) for k, v in sorted(stages.items())},
        "server_cache": {"hits": hits, "misses": misses,
                         "hit_rate": hits / (hits + misses) if hits + misses else None},
        "prefix_cache": _prefix_cache(done),
    }


def _prefix_cache(done: list[RequestRecord]) -> dict[str, Any]:
    """Prompt tokens the target's prefix cache supplied, of those it reported (usage)."""
    cached = sum(r.cached_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    return {"cached_tokens": cached, "prompt_tokens": prompt,
            "hit_rate": cached / prompt if prompt else None}
