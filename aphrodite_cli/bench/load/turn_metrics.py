"""A session phase's results per turn index (``phase["per_turn"]``, see
:mod:`aphrodite_cli.bench.load.sessions`).

- ``turns``: one entry per turn index (from 1): requests sent, completed, failed; TTFT p50,
  p90 and mean (ms, completed turns); prompt and output tokens (mean and total, from the
  server's ``usage``); and the prefix cache hit rate of that turn =
  ``usage.prompt_tokens_details.cached_tokens`` / ``usage.prompt_tokens`` summed over its
  completed requests (None when the target reported no prompt tokens). The server's own
  counters are global, so a per-turn rate can only come from each answer's usage (vLLM
  reports it with ``--enable-prompt-tokens-details``; this project's server always).
- ``prefix_cache_server``: the whole phase's hit rate as the server counted it on
  ``/metrics`` (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas; None
  when it has no such counters or ``/metrics`` was not scraped).
- ``sessions``: sessions started, those whose every turn completed, and turns sent.
"""

from __future__ import annotations

from typing import Any

from aphrodite_cli.bench.load.metrics import RequestRecord
from aphrodite_cli.bench.results.stats import summary


def _ttft(records: list[RequestRecord]) -> dict[str, Any]:
    values = [r.ttft * 1e3 for r in records if r.ok and r.ttft is not None]
    s = summary(values)
    return {"count": s["count"], "p50": s.get("median"), "p90": s.get("p90"),
            "mean": s.get("mean")}


def _tokens(values: list[int]) -> dict[str, Any]:
    return {"mean": sum(values) / len(values) if values else None, "total": sum(values)}


def per_turn(records: list[RequestRecord], placement: list[tuple[int, int]],
             sessions: int, planned: dict[int, int], server: dict[str, Any] | None
             ) -> dict[str, Any]:
    """``records`` (one per turn sent) grouped by turn index (``placement``: each record's
    session and turn); ``planned``: each session's number of turns; ``server``: the phase's
    ``server_metrics`` (or None)."""
    by_turn: dict[int, list[RequestRecord]] = {}
    done_turns: dict[int, int] = {}
    for record, (session, turn) in zip(records, placement, strict=True):
        by_turn.setdefault(turn, []).append(record)
        if record.ok:
            done_turns[session] = done_turns.get(session, 0) + 1
    turns = []
    for turn in sorted(by_turn):
        group = by_turn[turn]
        done = [r for r in group if r.ok]
        usage = [r for r in done if r.usage_reported]
        prompt = sum(r.prompt_tokens for r in usage)
        turns.append({
            "turn": turn, "requests": len(group), "completed": len(done),
            "failed": sum(1 for r in group if not r.ok and not r.cancelled),
            "cancelled": sum(1 for r in group if r.cancelled), "ttft_ms": _ttft(group),
            "prompt_tokens": _tokens([r.prompt_tokens for r in usage]),
            "output_tokens": _tokens([r.output_tokens for r in done]),
            "cached_tokens": sum(r.cached_tokens for r in usage),
            "prefix_hit_rate": sum(r.cached_tokens for r in usage) / prompt if prompt
            else None})
    prefix = ((server or {}).get("prefix_cache") or {}) if (server or {}).get("available") \
        else {}
    return {"turns": turns,
            "prefix_cache_server": prefix.get("hit_rate") if prefix else None,
            "sessions": {"started": len({s for s, _ in placement}), "planned": sessions,
                         "completed": sum(1 for s, n in planned.items()
                                          if done_turns.get(s, 0) == n),
                         "turns_sent": len(records)}}
