"""``bench serve``'s checks of flags that go together (vLLM's rules where it has them), each a
one-line error naming the flags, before anything is sent."""

from __future__ import annotations

import math
from typing import Any

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


def check_session_flags(*, conversation_num: int | None, turn_mean: float, turn_stddev: float,
                        delay_mean: float, delay_stddev: float, num_users: int | None,
                        user_centric_rate: float | None, request_rate: float,
                        ramp_up_strategy: str | None, dataset: str, endpoint: str) -> Any:
    """The multi-turn flags (AIPerf's rules where it has them) as one-line errors; the
    sessions' :class:`~aphrodite_cli.bench.load.sessions.SessionConfig`, or None without
    ``--conversation-num``."""
    from aphrodite_cli.bench.load.sessions import SessionConfig

    values = {"--conversation-turn-mean": turn_mean, "--conversation-turn-stddev": turn_stddev,
              "--conversation-turn-delay-mean": delay_mean,
              "--conversation-turn-delay-stddev": delay_stddev,
              "--user-centric-rate": user_centric_rate}
    for flag, value in values.items():
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} {value} is not a finite number", code="invalid_flag")
    defaults = {"--conversation-turn-mean": 1.0, "--conversation-turn-stddev": 0.0,
                "--conversation-turn-delay-mean": 0.0, "--conversation-turn-delay-stddev": 0.0,
                "--user-centric-rate": None}
    if conversation_num is None:
        given = [f for f, v in values.items() if v != defaults[f]] + (
            ["--num-users"] if num_users is not None else [])
        if given:
            raise ConfigError(f"{given[0]} shapes multi-turn sessions, which need "
                              "--conversation-num N", code="invalid_flag")
        return None
    if conversation_num < 1:
        raise ConfigError(f"--conversation-num {conversation_num} is below 1",
                          code="invalid_flag")
    if turn_mean < 1:
        raise ConfigError(f"--conversation-turn-mean {turn_mean:g} is below 1 (a session has "
                          "at least one turn)", code="invalid_flag")
    for flag in ("--conversation-turn-stddev", "--conversation-turn-delay-mean",
                 "--conversation-turn-delay-stddev"):
        if values[flag] < 0:
            raise ConfigError(f"{flag} {values[flag]:g} is below 0", code="invalid_flag")
    if not endpoint.rstrip("/").endswith("chat/completions"):
        raise ConfigError(f"--conversation-num sends chat histories, which --endpoint "
                          f"{endpoint} cannot take", hint="use /v1/chat/completions",
                          code="invalid_flag")
    if dataset in ("trace", "mooncake", "timed_trace"):
        raise ConfigError(f"--conversation-num builds sessions on the dataset's requests; "
                          f"--dataset-name {dataset} sets its own arrival times",
                          code="invalid_flag")
    if (num_users is None) != (user_centric_rate is None):
        raise ConfigError("--user-centric-rate and --num-users go together (AIPerf's "
                          "user-centric mode: each user sends a turn every num-users / rate "
                          "seconds)", code="invalid_flag")
    if num_users is not None and user_centric_rate is not None:
        if num_users < 1:
            raise ConfigError(f"--num-users {num_users} is below 1", code="invalid_flag")
        if user_centric_rate <= 0:
            raise ConfigError(f"--user-centric-rate {user_centric_rate:g} is not above 0",
                              code="invalid_flag")
        if not math.isinf(request_rate) or ramp_up_strategy:
            raise ConfigError("--user-centric-rate sets the request rate itself",
                              hint="drop --request-rate / --ramp-up-strategy",
                              code="invalid_flag")
        if delay_mean or delay_stddev:
            raise ConfigError("--user-centric-rate spaces each user's turns itself "
                              "(num-users / rate seconds apart)",
                              hint="drop --conversation-turn-delay-mean/-stddev",
                              code="invalid_flag")
        if turn_mean < 2:
            raise ConfigError(f"--conversation-turn-mean {turn_mean:g}: user-centric sessions "
                              "have at least 2 turns on average (AIPerf's rule)",
                              code="invalid_flag")
    return SessionConfig(conversation_num, turn_mean, turn_stddev, delay_mean, delay_stddev,
                         num_users, user_centric_rate)
