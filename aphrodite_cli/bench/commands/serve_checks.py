"""``bench serve``'s checks of flags that go together (vLLM's rules where it has them), each a
one-line error naming the flags, before anything is sent."""

from __future__ import annotations

import math

from engine.errors import ConfigError


def trace_seconds(dataset: str, scale: float, multiplier: float | None) -> float:
    """Seconds per timestamp unit of a Mooncake trace: vLLM's --timed-trace-sec-multiplier,
    or Mooncake's milliseconds times --trace-time-scale."""
    if multiplier is None:
        return 0.001 * scale
    if dataset not in ("mooncake", "timed_trace"):
        raise ConfigError("--timed-trace-sec-multiplier times a mooncake/timed_trace trace",
                          hint="--trace-time-scale scales --dataset-name trace",
                          code="invalid_flag")
    if scale != 1.0:
        raise ConfigError("--trace-time-scale and --timed-trace-sec-multiplier both set the "
                          "replay's pace", hint="pass one of them", code="invalid_flag")
    if not math.isfinite(multiplier):
        raise ConfigError(f"--timed-trace-sec-multiplier {multiplier} is not finite",
                          code="invalid_flag")
    return multiplier


def check_token_flags(dataset: str, input_len: int | None, ratio: float,
                      archetypes: str | None) -> None:
    """Where --random-input-len and --random-range-ratio apply, as one-line errors."""
    if ratio >= 1:
        raise ConfigError(f"--random-range-ratio {ratio:g} is below 1 (vLLM's rule)",
                          code="invalid_flag")
    if ratio and input_len is None:
        raise ConfigError("--random-range-ratio needs --random-input-len (lengths in tokens)",
                          code="invalid_flag")
    if input_len is not None and (dataset not in ("random-mm", "random") or archetypes):
        raise ConfigError(f"--random-input-len writes the random dataset's prompts, not "
                          f"{'--archetypes' if archetypes else '--dataset-name ' + dataset}'s",
                          hint="--prefix-repetition-* set prefix_repetition's lengths",
                          code="invalid_flag")


def check_ramp_up(strategy: str | None, start: float | None, end: float | None,
                  rate: float) -> None:
    """vLLM's rules for --ramp-up-strategy and its rates, as one-line errors."""
    if strategy is None:
        if start is not None or end is not None:
            raise ConfigError("--ramp-up-start-rps/--ramp-up-end-rps need --ramp-up-strategy "
                              "linear or exponential", code="invalid_flag")
        return
    if not math.isinf(rate):
        raise ConfigError("--ramp-up-strategy sets the request rate itself",
                          hint="drop --request-rate", code="invalid_flag")
    if start is None or end is None:
        raise ConfigError("--ramp-up-strategy needs both --ramp-up-start-rps and "
                          "--ramp-up-end-rps", code="invalid_flag")
    if start < 0 or end < 0 or start > end or (end == 0):
        raise ConfigError(f"--ramp-up-start-rps {start:g} and --ramp-up-end-rps {end:g}: the "
                          "rates are non-negative, the start at most the end, the end above 0",
                          code="invalid_flag")
    if strategy == "exponential" and start == 0:
        raise ConfigError("an exponential ramp cannot start at 0 requests/s",
                          hint="--ramp-up-start-rps above 0, or --ramp-up-strategy linear",
                          code="invalid_flag")
