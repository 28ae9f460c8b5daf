"""A generation request as the engine sees it, and what comes back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.executor.sampling import SamplingParams
from engine.processing.preprocess import ProcessedPrompt

_ids = itertools.count()


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class TokenEvent:
    """One step for one sequence: the new text, and the finish reason when it ended."""

    request_id: str
    index: int
    token_id: int | None
    text_delta: str
    finish_reason: str | None = None


@dataclass
class EngineRequest:
    prompt: ProcessedPrompt
    params: SamplingParams
    on_event: Callable[[TokenEvent], None] | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    outputs: list[CompletionOutput] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    on_done: Callable[[EngineRequest], None] | None = None

    def finish(self) -> None:
        """Mark done (the engine thread calls this once) and run ``on_done``: a caller that
        must act on completion needs no thread of its own waiting on ``done``."""
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    def cancel(self) -> None:
        """The client went away: stop generating for it at the next step."""
        self.cancelled.set()
