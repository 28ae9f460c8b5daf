"""A serve result's sections as text, shared by the console (``bench serve``) and the report:
the server CPU line (a phase's ``server_cpu``, see :mod:`aphrodite_cli.bench.load.server_cpu`)
and the per-turn table (a session phase's ``per_turn``, see
:mod:`aphrodite_cli.bench.load.turn_metrics`). They read result fields only, so a result file
written earlier prints the same."""

from __future__ import annotations

from typing import Any


def describe(cpu: dict[str, Any]) -> str:
    """One line: the target's CPU per request and its busiest processes."""
    if cpu.get("cpu_s") is None:
        return f"server CPU: not measured ({cpu.get('status')})"
    parts = ", ".join(f"{p['name']} {p['cpu_ms_per_request']:.1f} ({p['cores']:.2f} cores)"
                      for p in cpu["processes"][:4]
                      if p["cpu_ms_per_request"] is not None and p["cores"] is not None)
    per = cpu.get("cpu_ms_per_request")
    return (f"server CPU: {'-' if per is None else f'{per:.1f}'} ms per request, "
            f"{cpu['cores']:.2f} cores busy; busiest: {parts or '-'} "
            f"(client {cpu['client_cpu_s']:.1f} s)")


#: The per-turn table's columns (console and report)
TURN_COLUMNS = ["turn", "ok/sent", "TTFT p50 ms", "TTFT p90 ms", "TTFT mean ms",
                "prompt tokens", "output tokens", "prefix hit"]


def turn_rows(section: dict[str, Any]) -> list[list[str]]:
    """``per_turn``'s turns as table rows (``-`` where a figure is unknown)."""

    def num(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for t in section.get("turns") or []:
        ttft = t.get("ttft_ms") or {}
        rows.append([str(t.get("turn")), f"{t.get('completed')}/{t.get('requests')}",
                     num(ttft.get("p50"), ".1f"), num(ttft.get("p90"), ".1f"),
                     num(ttft.get("mean"), ".1f"),
                     num((t.get("prompt_tokens") or {}).get("mean"), ".0f"),
                     num((t.get("output_tokens") or {}).get("mean"), ".0f"),
                     num(t.get("prefix_hit_rate"), ".0%")])
    return rows


def turn_title(phase: str, section: dict[str, Any]) -> str:
    """The per-turn table's title: the sessions and the server's run-wide hit rate."""
    s = section.get("sessions") or {}
    server = section.get("prefix_cache_server")
    return (f"{phase}: per turn ({s.get('completed')}/{s.get('started')} sessions complete, "
            f"{s.get('turns_sent')} turns; server prefix cache hit rate over the phase "
            f"{'-' if server is None else format(server, '.0%')} by /metrics)")
