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
#: OpenAI's bounds: at most this many ``logit_bias`` entries, each from -100 to 100
MAX_LOGIT_BIAS, LOGIT_BIAS_LIMIT = 300, 100.0
#: the most ``stop_token_ids`` and ``bad_words`` one request may carry (each bad word up to
#: MAX_BAD_WORD_CHARS characters): bounds on the per-step work they cost
MAX_STOP_TOKEN_IDS, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 64, 64, 256


def _bad(name: str, value: object, rule: str) -> InvalidRequestError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return InvalidRequestError(f"{name}={shown} {rule}", code="invalid_sampling_params",
                               param=name)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
        value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(bias: object) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: a map of token ids (ints, or decimal strings as JSON writes
    them) to biases from -100 to 100, at most MAX_LOGIT_BIAS entries."""
    if bias is None:
        return None
    rule = (f"must map up to {MAX_LOGIT_BIAS} token ids to numbers from "
            f"{-LOGIT_BIAS_LIMIT:g} to {LOGIT_BIAS_LIMIT:g}")
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", bias if not isinstance(bias, dict) else f"<{len(bias)} "
                   "entries>", rule)
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if _integer(key) else int(key) if isinstance(key, str) and \
            key.isascii() and key.isdigit() and len(key) <= 12 else None
        if token is None or token < 0 or not _number(value) or not \
                -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise _bad("logit_bias", {key: value}, rule)
        out[token] = float(value)
    return out or None


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
    #: OpenAI's penalties (-2 to 2) on the generated tokens: ``presence_penalty`` once per
    #: token that appeared, ``frequency_penalty`` times its count; vLLM's and Hugging Face's
    #: ``repetition_penalty`` (> 0, 1 is off) over the prompt's and the generated tokens
    #: (engine/executor/logits_processors.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: OpenAI's ``logit_bias``: token id (an int, or its decimal string as JSON sends it) ->
    #: a bias from -100 to 100 added to its logit; kept as ``{int: float}``
    logit_bias: dict[int, float] | None = None
    #: vLLM's: a token whose probability is under ``min_p`` times the most likely one's is
    #: not sampled (0 is off)
    min_p: float = 0.0
    #: vLLM's: EOS, ``stop_token_ids`` and stop strings do not end the row before this many
    #: tokens (its end tokens are banned until then)
    min_tokens: int = 0
    #: vLLM's: these tokens end the row as EOS does
    stop_token_ids: list[int] = field(default_factory=list)
    #: vLLM's: words whose tokens are never generated in that order
    bad_words: list[str] = field(default_factory=list)
    #: vLLM's: special tokens are left out of the output text (true by default)
    skip_special_tokens: bool = True
    #: vLLM's: the stop string that ended the row stays at the end of its text
    include_stop_str_in_output: bool = False

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise _bad(name, getattr(self, name), "must be between -2 and 2")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise _bad("repetition_penalty", self.repetition_penalty,
                       "must be greater than 0 (1 is off) and at most 100")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "must be between 0 and 1")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens,
                       f"must be an integer from 0 to max_tokens ({self.max_tokens})")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
                _integer(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", ids, f"must be a list of up to {MAX_STOP_TOKEN_IDS} "
                                              "token ids")
        object.__setattr__(self, "stop_token_ids", list(ids))
        words = self.bad_words
        if not isinstance(words, list | tuple) or len(words) > MAX_BAD_WORDS or not all(
                isinstance(w, str) and 0 < len(w.strip()) <= MAX_BAD_WORD_CHARS for w in words):
            raise _bad("bad_words", words, f"must be a list of up to {MAX_BAD_WORDS} non-empty "
                                           f"strings of at most {MAX_BAD_WORD_CHARS} characters")
        object.__setattr__(self, "bad_words", list(words))
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be true or false")
        object.__setattr__(self, "structured_outputs", from_fields(self.structured_outputs))
