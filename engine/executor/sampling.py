"""Sampling parameters, validated at the top (a bad value names itself and its range)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.executor.structured import GrammarSpec, from_fields

MAX_TOKENS_CAP = 4096
MAX_N = 16
#: the most top log-probabilities one token may report (OpenAI's and vLLM's default limit)
MAX_LOGPROBS = 20
#: torch's 64-bit generator seed range (as vLLM's); row i of ``n`` samples with seed + i.
#: All 64 bits choose the row's random stream (engine/executor/sampler.py seeded_generator).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
#: a temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): logits divided by a
#: subnormal or tiny temperature overflow float32 to inf, and their softmax is NaN
SAMPLING_EPS = 1e-5


def _bad(name: str, value: object, rule: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name}={value!r} {rule}", code="invalid_sampling_params",
                               param=name)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` 0 (or below :data:`SAMPLING_EPS`) is greedy; ``top_k``
    0 or -1 is off; ``stop`` strings end the text (not included); ``seed`` makes sampling
    repeatable per request (all of its 64 bits count).
    ``logprobs`` (vLLM's meaning): None reports none; k (0..20) reports each generated token's
    log-probability and the k most likely tokens', from the model's raw distribution
    (log_softmax of the logits, before temperature/top-k/top-p: vLLM's default
    ``logprobs_mode="raw_logprobs"``)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    #: vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": ...}``,
    #: ``{"choice": [...]}``, ``{"grammar": ebnf}`` or ``{"json_object": True}`` (checked and
    #: kept as a :class:`~engine.executor.structured.GrammarSpec`)
    structured_outputs: GrammarSpec | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or not (
                1 <= self.max_tokens <= MAX_TOKENS_CAP):
            raise _bad("max_tokens", self.max_tokens, f"must be an integer from 1 to "
                                                      f"{MAX_TOKENS_CAP}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or not 0 <= self.temperature <= 2:
            raise _bad("temperature", self.temperature, "must be between 0 and 2")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)  # greedy
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be -1, 0 (off) or a positive integer")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise _bad("n", self.n, f"must be an integer from 1 to {MAX_N}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise _bad("seed", self.seed, f"must be an integer from {SEED_MIN} to {SEED_MAX}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(
                self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"must be an integer from 0 to {MAX_LOGPROBS}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 8 or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop):
            raise _bad("stop", self.stop, "must be up to 8 non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "structured_outputs", from_fields(self.structured_outputs))
