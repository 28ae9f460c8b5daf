"""A row: one sequence of a request (``n`` > 1 makes ``n`` rows), as the engine, its runner
and :func:`~engine.executor.stop.check_stop` see it. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.executor.detokenize import OutputText
from engine.executor.request import EngineRequest


@dataclass(eq=False)
class Row:
    request: EngineRequest
    index: int
    generator: Any
    token_ids: list[int] = field(default_factory=list)
    output: OutputText | None = None
    done: bool = False
    finish_reason: str | None = None
    first_token_at: float | None = None
    #: the prefill's encoder time up to this row's first token (its stage timings)
    encoder_s: float = 0.0
    #: the token to feed at the next step, and the text position it takes (M-RoPE rows add
    #: ``rope_delta``: the prompt's vision tokens span fewer positions than tokens)
    last_token: int = 0
    position: int = 0
    rope_delta: int = 0
    #: the row's grammar matcher (structured outputs), made on its first step
    matcher: Any = None
    #: its logits processors' state (penalties, logit_bias, ...), made on its first step
    logits_state: Any = None
