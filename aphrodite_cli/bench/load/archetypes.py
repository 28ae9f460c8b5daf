"""Media-mix archetypes (``--archetypes``): named request kinds with weights, and every headline
metric broken down per kind and per modality.

``--archetypes`` is JSON (or a file holding it): ``{"name": {"weight": w, "items": n,
"buckets": {"height,width,frames": p}, "prompt_len": words, "output_len": tokens}}``;
``weight`` is relative (the weights are normalised), ``items`` (default 1; 0 is text only),
``buckets`` (the ``--bucket-config`` form; default the run's), ``prompt_len`` and
``output_len`` (default the run's). Each request draws its kind by weight, seeded: the same
seed gives the same mix.

The breakdown (``phase["by_kind"]``, ``phase["by_modality"]``) uses the phase's own formulas
(:mod:`aphrodite_cli.bench.load.metrics`) on each group's requests; a group's throughputs are
its completed requests and tokens over the whole phase's duration, so the groups' throughputs
add up to the phase's. A request's modality is the set of its media kinds (``image``,
``video``, ``audio``, ``image+video``...) or ``text``.

Media tokens per request (``mm_tokens``): the target's ``usage.prompt_tokens_details``
(``image_tokens``, ``video_tokens``, ``audio_tokens``) when it reports them, else the counts in
this project's exposed request details (``aphrodite.mm_tokens``) when present, else unknown
(said, never guessed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.data.datasets import _WORDS, BenchRequest, MediaSpec, parse_buckets
from aphrodite_cli.bench.load.metrics import RequestRecord, compute
from engine.errors import ConfigError

MODALITIES = ("image", "video", "audio")
_FIELDS = {"weight", "items", "buckets", "prompt_len", "output_len"}


def parse_archetypes(text: str | None) -> dict[str, dict[str, Any]] | None:
    """``--archetypes`` (JSON, or the path of a file holding it) -> name -> its settings,
    weights normalised to 1; None when not given."""
    if not text:
        return None
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as exc:
            raise ConfigError(f"--archetypes {text!r} is neither JSON nor a readable file "
                              f"({exc.strerror or exc})", code="invalid_flag") from None
    try:
        raw = json.loads(source)
    except ValueError:
        raise ConfigError("--archetypes is not valid JSON", hint='e.g. {"photo": {"weight": 3, '
                          '"buckets": {"480,640,1": 1}}, "chat": {"weight": 1, "items": 0}}',
                          code="invalid_flag") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("--archetypes is a JSON object of name -> settings",
                          code="invalid_flag")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or set(spec) - _FIELDS:
            raise ConfigError(f"--archetypes {name!r}: settings are an object of "
                              f"{', '.join(sorted(_FIELDS))}", code="invalid_flag")
        weight = spec.get("weight", 1)
        items = spec.get("items", 1)
        if not isinstance(weight, int | float) or weight <= 0 or not isinstance(items, int) \
                or items < 0:
            raise ConfigError(f"--archetypes {name!r}: weight must be > 0 and items an "
                              "integer >= 0", code="invalid_flag")
        for key in ("prompt_len", "output_len"):
            if key in spec and (not isinstance(spec[key], int) or spec[key] < 1):
                raise ConfigError(f"--archetypes {name!r}: {key} must be an integer >= 1",
                                  code="invalid_flag")
        buckets = (parse_buckets(json.dumps(spec["buckets"])) if "buckets" in spec else None)
        out[str(name)] = {"weight": float(weight), "items": items, "buckets": buckets,
                          "prompt_len": spec.get("prompt_len"),
                          "output_len": spec.get("output_len")}
    total = sum(a["weight"] for a in out.values())
    for a in out.values():
        a["weight"] /= total
    return out


def archetype_dataset(num: int, archetypes: dict[str, dict[str, Any]], *,
                      buckets: dict, prompt_len: int, output_len: int, seed: int, nonce: int
                      ) -> list[BenchRequest]:
    """``num`` requests, each of a kind drawn by weight (deterministic for seed and nonce)."""
    rng = random.Random(seed)
    names, weights = list(archetypes), [a["weight"] for a in archetypes.values()]
    requests = []
    for i in range(num):
        name = rng.choices(names, weights)[0]
        kind = archetypes[name]
        mix = kind["buckets"] or buckets
        keys, probs = list(mix), list(mix.values())
        media = []
        for k in range(kind["items"]):
            h, w, f = rng.choices(keys, probs)[0]
            media.append(MediaSpec("video" if f > 1 else "image", w, h, f,
                                   seed=nonce * 1_000_000 + i * 100 + k))
        words = " ".join(rng.choice(_WORDS) for _ in range(kind["prompt_len"] or prompt_len))
        requests.append(BenchRequest(words, media, kind["output_len"] or output_len,
                                     kind=name))
    return requests


def modality(req: BenchRequest) -> str:
    """``text``, or the request's media kinds joined by ``+``."""
    kinds = {m.kind for m in req.media}
    for message in req.messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type", "") if isinstance(part, dict) else ""
            if kind in ("image_url", "video_url", "audio_url"):
                kinds.add(kind.removesuffix("_url"))
            elif kind == "input_audio":
                kinds.add("audio")
    return "+".join(k for k in MODALITIES if k in kinds) or "text"


def mm_tokens(record: RequestRecord) -> tuple[dict[str, int] | None, str]:
    """(media tokens by modality, where they came from), or (None, "unknown")."""
    details = getattr(record, "prompt_details", None)
    if isinstance(details, dict):
        found = {m: int(details[f"{m}_tokens"]) for m in MODALITIES
                 if isinstance(details.get(f"{m}_tokens"), int | float)}
        if found:
            return found, "usage.prompt_tokens_details"
    exposed = (record.server or {}).get("mm_tokens")
    if isinstance(exposed, dict):  # {} from this server: no media token
        return {str(k): int(v) for k, v in exposed.items() if isinstance(v, int | float)
                }, "aphrodite.mm_tokens"
    return None, "unknown"


def mm_token_summary(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Media tokens per completed request (by modality) and per second of the phase."""
    per: dict[str, list[int]] = {}
    sources = set()
    known = 0
    done = [r for r in records if r.ok]
    for r in done:
        counts, source = mm_tokens(r)
        sources.add(source)
        if counts is None:
            continue
        known += 1
        for m, n in counts.items():
            per.setdefault(m, []).append(n)
    from aphrodite_cli.bench.results.stats import summary

    return {"source": " + ".join(sorted(sources)) or "unknown",
            "requests_with_counts": known, "requests": len(done),
            "per_request": {m: summary(v) for m, v in sorted(per.items())},
            "throughput": {f"{m}_tokens_per_s": sum(v) / duration_s if duration_s else 0.0
                           for m, v in sorted(per.items())}}


def _headline(records: list[RequestRecord], duration_s: float, slos: dict[str, float]
              ) -> dict[str, Any]:
    m = compute(records, duration_s, slos)
    keep = ("completed", "failed", "failures_by_type", "request_throughput",
            "output_throughput", "total_output_tokens", "total_input_tokens",
            "input_token_throughput", "total_token_throughput", "goodput", "ttft_ms",
            "tpot_ms", "itl_ms", "e2e_ms", "ttst_ms", "output_token_throughput_per_user")
    out = {k: m[k] for k in keep}
    out["mm_tokens"] = mm_token_summary(records, duration_s)
    return out


def breakdown(dataset: list[BenchRequest], records: list[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """``{"by_kind": {...}, "by_modality": {...}}``: the headline metrics of each group (kinds
    only when the requests carry one)."""
    by_kind: dict[str, list[RequestRecord]] = {}
    by_modality: dict[str, list[RequestRecord]] = {}
    for req, rec in zip(dataset, records, strict=True):
        if req.kind is not None:
            by_kind.setdefault(req.kind, []).append(rec)
        by_modality.setdefault(modality(req), []).append(rec)
    return {"by_kind": {k: _headline(v, duration_s, slos or {}) for k, v in sorted(
                by_kind.items())},
            "by_modality": {k: _headline(v, duration_s, slos or {}) for k, v in sorted(
                by_modality.items())}}
