"""The peer comparison's table: medians over the repeats, per model size, load and phase.

    python scripts/peer_summary.py OUT_DIR

reads OUT_DIR/<size>-out<LEN>[-rate<RATE>]-c<CONC>-r<N>-<vllm|ours>[@BIND].json (``aphrodite
bench serve`` result files; the size prefix is optional; ``-rate``: requests sent at that
rate, an open loop, instead of a closed loop of CONC clients; ``@BIND``: vLLM run with
``VLLM_CPU_OMP_THREADS_BIND=BIND`` ('+' for '|') and ours measured beside it, none: vLLM's
own binding, "auto") and writes OUT_DIR/summary.md and summary.json: for each phase a run has
(cold, warm), requests/s and TPOT p50 of both servers side by side, TTFT p50 of both, the
ratios ours / vLLM, the mean prompt tokens of both (equal work) and failures; and for ours,
the warm TTFT p50 over the cold one (a warm request should skip encoder and prefill).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"(?:(?P<size>[a-z0-9_]+)-)?out(?P<len>\d+)(?:-rate(?P<rate>\d+(?:\.\d+)?))?"
                  r"-c(?P<conc>\d+)-r(?P<rep>\d+)-(?P<side>vllm|ours)"
                  r"(?:@(?P<bind>[0-9][0-9,+-]*))?\.json")
PHASES = ("cold", "warm")
HEAD = ["size", "load", "vLLM binding", "phase", "runs v/o", "vLLM req/s", "ours req/s",
        "req/s ours/vLLM", "vLLM TPOT p50 ms", "ours TPOT p50 ms", "TPOT ours/vLLM",
        "vLLM TTFT p50 ms", "ours TTFT p50 ms", "TTFT ours/vLLM", "prompt tok v/o",
        "server CPU ms/req v/o", "busiest process cores v/o", "failed v/o"]


def _runs(out: Path) -> dict:
    runs: dict = {}
    for path in sorted(out.glob("*.json")):
        m = NAME.fullmatch(path.name)
        if not m:
            continue
        doc = json.loads(path.read_text())
        for phase in PHASES:
            p = (doc.get("phases") or {}).get(phase)
            if not p:
                continue
            prompts = [r["prompt_tokens"] for r in (doc.get("requests") or {}).get(phase, [])
                       if r.get("prompt_tokens")]
            key = (m["size"] or "-", int(m["len"]), int(m["conc"]),
                   float(m["rate"]) if m["rate"] else None,
                   (m["bind"] or "auto").replace("+", "|"), phase)
            runs.setdefault(key, {}).setdefault(m["side"], []).append({
                "rps": p.get("request_throughput"), "ttft_p50": p.get("p50_ttft_ms"),
                "tpot_p50": p.get("p50_tpot_ms"), "failed": p.get("failed", 0),
                "cpu_ms": (p.get("server_cpu") or {}).get("cpu_ms_per_request"),
                "busiest_cores": max((q["cores"] for q in (p.get("server_cpu") or {}).get(
                    "processes", []) if q.get("cores") is not None), default=None),
                "prompt_tokens": statistics.mean(prompts) if prompts else None})
    return runs


def _load(length: int, conc: int, rate: float | None) -> str:
    """A load's label: its output length and concurrency, and its request rate if open."""
    return f"{length} tok, c{conc}" + ("" if rate is None else f", {rate:g} req/s")


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summarize(out: Path) -> tuple[list[dict], list[str]]:
    """The summary rows (summary.json) and the Markdown table (summary.md)."""
    summary, rows = [], []
    runs = _runs(out)
    order = {p: i for i, p in enumerate(PHASES)}
    binds = {b: i for i, b in enumerate(sorted({k[4] for k in runs}, key=lambda b: (
        b != "auto", b)))}  # vLLM's own binding first
    for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], k[3] or 0.0, binds[k[4]],
                                           order[k[5]])):
        size, length, conc, rate, bind, phase = key
        v, o = runs[key].get("vllm", []), runs[key].get("ours", [])
        s = {"size": size, "output_len": length, "concurrency": conc, "request_rate": rate,
             "vllm_binding": bind, "phase": phase, "load": _load(length, conc, rate),
             "runs_vllm": len(v), "runs_ours": len(o),
             **{f"{k}_{side}": _med(rs, k) for side, rs in (("vllm", v), ("ours", o))
                for k in ("rps", "ttft_p50", "tpot_p50", "prompt_tokens", "cpu_ms",
                          "busiest_cores")},
             "failed_vllm": sum(r["failed"] for r in v),
             "failed_ours": sum(r["failed"] for r in o)}
        s["rps_ratio"] = _ratio(s["rps_ours"], s["rps_vllm"])
        s["ttft_p50_ratio"] = _ratio(s["ttft_p50_ours"], s["ttft_p50_vllm"])
        s["tpot_p50_ratio"] = _ratio(s["tpot_p50_ours"], s["tpot_p50_vllm"])
        if phase == "warm":
            cold = next((c for c in summary if c["phase"] == "cold" and
                         (c["size"], c["output_len"], c["concurrency"],
                          c["request_rate"], c["vllm_binding"]) == key[:5]), None)
            if cold is not None:
                s["ours_warm_over_cold_ttft"] = _ratio(s["ttft_p50_ours"], cold["ttft_p50_ours"])
                s["vllm_warm_over_cold_ttft"] = _ratio(s["ttft_p50_vllm"], cold["ttft_p50_vllm"])
        summary.append(s)
        rows.append([size, s["load"], bind.replace("|", "\\|"), phase, f"{len(v)}/{len(o)}",
                     _fmt(s["rps_vllm"], ".2f"), _fmt(s["rps_ours"], ".2f"),
                     _fmt(s["rps_ratio"], ".2f"), _fmt(s["tpot_p50_vllm"], ".1f"),
                     _fmt(s["tpot_p50_ours"], ".1f"), _fmt(s["tpot_p50_ratio"], ".2f"),
                     _fmt(s["ttft_p50_vllm"], ".0f"), _fmt(s["ttft_p50_ours"], ".0f"),
                     _fmt(s["ttft_p50_ratio"], ".2f"),
                     f"{_fmt(s['prompt_tokens_vllm'], '.0f')}/"
                     f"{_fmt(s['prompt_tokens_ours'], '.0f')}",
                     f"{_fmt(s['cpu_ms_vllm'], '.0f')}/{_fmt(s['cpu_ms_ours'], '.0f')}",
                     f"{_fmt(s['busiest_cores_vllm'], '.2f')}/"
                     f"{_fmt(s['busiest_cores_ours'], '.2f')}",
                     f"{s['failed_vllm']}/{s['failed_ours']}"])
    md = ["Medians over the repeats, per phase; ratios are ours / vLLM (req/s: above 1 is ours "
          "faster; TPOT and TTFT: below 1 is ours faster). vLLM binding: its "
          "VLLM_CPU_OMP_THREADS_BIND (auto: its own), ours measured beside each. Server "
          "CPU: the CPU time all of a server's "
          "processes spent per request (bench serve's server_cpu); busiest process cores: "
          "the CPU that server's busiest process kept busy over the phase (near 1.00: the "
          "process the server waited on).", "",
          "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    warm = [s for s in summary if s.get("ours_warm_over_cold_ttft") is not None]
    if warm:
        md += ["", "Warm TTFT p50 over cold (a warm request should skip encoder and prefill):",
               ""]
        md += [f"- {s['size']}, {s['load']}, vLLM binding {s['vllm_binding']}: ours "
               f"{_fmt(s['ours_warm_over_cold_ttft'], '.2f')}, vLLM "
               f"{_fmt(s['vllm_warm_over_cold_ttft'], '.2f')}" for s in warm]
    return summary, md


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[1])
    summary, md = summarize(out)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(md))
    return 0 if summary else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
