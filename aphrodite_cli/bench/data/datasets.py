"""Benchmark datasets shared by `bench serve` (and, in time, `bench mm-processor`).

- random-mm: each request has ``items`` media drawn from a bucket config
  ``{(height, width, frames): probability}`` (frames > 1 is a video), a prompt of about
  ``prompt_len`` words and ``output_len`` output tokens. Media are synthetic but codec-real
  (structure and motion), made deterministically from a seed.
- jsonl: one request per line, ``{"messages": [...], "output_len": N}`` with media URLs or
  paths (paths are read from --media-dir and sent inline).
Cold runs give every measured request media nobody has sent before (a per-run nonce enters the
seeds); warm runs send the same media in an unmeasured warm-up pass first.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.data.media_files import read_lines, read_media
from aphrodite_cli.bench.harness.media_host import MediaHost
from aphrodite_cli.bench.harness.synthetic_caps import check_size
from engine.errors import ConfigError

_WORDS = ("the", "cat", "sat", "on", "a", "red", "mat", "near", "an", "open", "window",
          "while", "rain", "fell", "over", "the", "quiet", "city", "and", "a", "small", "dog",
          "watched", "birds", "crossing", "the", "grey", "sky", "above", "old", "roofs")
DEFAULT_BUCKETS = {(480, 640, 1): 0.5, (720, 1280, 1): 0.3, (240, 320, 16): 0.2}


@dataclass(frozen=True)
class MediaSpec:
    kind: str  # image | video
    width: int
    height: int
    frames: int
    seed: int

    @property
    def name(self) -> str:
        ext = "jpg" if self.kind == "image" else "mp4"
        return f"{self.kind}-{self.width}x{self.height}x{self.frames}-{self.seed}.{ext}"


@dataclass
class BenchRequest:
    prompt: str
    media: list[MediaSpec] = field(default_factory=list)
    output_len: int = 16
    messages: list[dict[str, Any]] | None = None  # jsonl requests carry their own
    kind: str | None = None  # its archetype (--archetypes), for the per-kind breakdown
    arrival_s: float | None = None  # when a replayed trace sends it (load/trace.py)
    #: the prompt tokens the server should count, when prompts are written in tokens
    input_len: int | None = None


def parse_buckets(text: str | None) -> dict[tuple[int, int, int], float]:
    """``'{"480,640,1": 0.5, "240,320,16": 0.5}'`` -> {(480, 640, 1): 0.5, ...}."""
    if not text:
        return dict(DEFAULT_BUCKETS)
    try:
        raw = json.loads(text)
        buckets = {tuple(int(x) for x in k.split(",")): v for k, v in raw.items()}
    except (ValueError, AttributeError, RecursionError):
        raise ConfigError(f"--bucket-config {text[:80]!r} is not a JSON object of "
                          '"height,width,frames": probability', code="invalid_bucket_config"
                          ) from None
    if not buckets or any(len(k) != 3 or min(k) < 1 for k in buckets) or any(
            isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1
            for p in buckets.values()) or abs(sum(buckets.values()) - 1) > 1e-6:
        raise ConfigError("--bucket-config keys are height,width,frames (>= 1) and the "
                          "probabilities numbers from 0 to 1 that add up to 1",
                          code="invalid_bucket_config")
    for h, w, f in buckets:  # type: ignore[misc]
        check_size("--bucket-config", w, h, f)
    return {k: float(p) for k, p in buckets.items()}  # type: ignore[misc]


def random_words(rng: random.Random, n: int) -> str:
    """n words drawn with ``rng`` (the random dataset's prompt text)."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_mm(num: int, *, items: int, buckets: dict[tuple[int, int, int], float],
              prompt_len: int, output_len: int, seed: int, nonce: int) -> list[BenchRequest]:
    """Deterministic for (seed, nonce): the same arguments give the same requests."""
    rng = random.Random(seed)
    keys, weights = list(buckets), list(buckets.values())
    requests = []
    for i in range(num):
        media = []
        for k in range(items):
            h, w, f = rng.choices(keys, weights)[0]
            media.append(MediaSpec("video" if f > 1 else "image", w, h, f,
                                   seed=nonce * 1_000_000 + i * 100 + k))
        requests.append(BenchRequest(random_words(rng, prompt_len), media, output_len))
    return requests


def render_media(spec: MediaSpec, *, image_format: str = "JPEG", quality: int = 90,
                 codec: str = "libx264", fps: int = 30, gop: int = 30) -> bytes:
    from aphrodite_cli.bench.harness import synthetic

    if spec.kind == "image":
        return synthetic.make_image(spec.width, spec.height, fmt=image_format, seed=spec.seed,
                                    quality=quality)
    return synthetic.make_video(width=spec.width, height=spec.height, fps=fps,
                                seconds=spec.frames / fps, codec=codec, gop=gop,
                                seed=spec.seed % (2**31))


def load_jsonl(path: Path, media_dir: Path | None) -> list[BenchRequest]:
    """Requests from a JSONL file; ``{"path": "x.jpg"}`` parts become data URLs."""
    requests = []
    for n, line in enumerate(read_lines(path, "dataset"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row["messages"]
        except (ValueError, RecursionError, KeyError, TypeError):
            raise ConfigError(f"{path}:{n} is not a JSON object with messages",
                              code="invalid_dataset") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ConfigError(f"{path}:{n}: messages is a list of objects",
                              code="invalid_dataset")
        output_len = row.get("output_len", 16)
        if type(output_len) is not int or not 1 <= output_len <= 1 << 20:
            raise ConfigError(f"{path}:{n}: output_len is a whole number from 1 to "
                              f"{1 << 20}, not {json.dumps(output_len)[:40]}",
                              code="invalid_dataset")
        for message in messages:
            for part in message.get("content") if isinstance(message.get("content"),
                                                             list) else []:
                for kind in ("image_url", "video_url", "audio_url"):
                    ref = part.get(kind) if isinstance(part, dict) else None
                    if isinstance(ref, dict) and "path" in ref:
                        data = read_media(media_dir, ref["path"], f"{path}:{n}")
                        mime = {"image_url": "image/jpeg", "video_url": "video/mp4",
                                "audio_url": "audio/wav"}[kind]
                        part[kind] = {"url": f"data:{mime};base64,"
                                             f"{base64.b64encode(data).decode()}"}
        requests.append(BenchRequest("", [], output_len, messages))
    return requests


def nonce() -> int:
    """A run's nonce: enters the media seeds, so a cold run's media were never sent before."""
    return random.SystemRandom().randrange(1, 1 << 20)


def media_url(spec: MediaSpec, data: bytes, host: MediaHost | None) -> str:
    """Where the target finds this item: the loopback media server, or a data URL."""
    mime = "image/jpeg" if spec.kind == "image" else "video/mp4"
    if host is not None:
        return host.add(f"/m/{spec.name}", data, mime)
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
