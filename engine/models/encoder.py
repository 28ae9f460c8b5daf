"""Timing a model's vision or audio encoder with forward hooks (the runner's encoder time and
``bench mm-processor``'s)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_encoder(model: Any, attr: str, add: Callable[[float], None]) -> bool:
    """After each forward pass of ``model``'s encoder (``model.<attr>`` or
    ``model.model.<attr>``), ``add(seconds it took)``; False when the model has none."""
    module = getattr(model, attr, None) or getattr(getattr(model, "model", None), attr, None)
    if module is None:
        return False
    starts: list[float] = []
    module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

    def after(*_: Any) -> None:
        if starts:
            add(time.perf_counter() - starts.pop())

    module.register_forward_hook(after)
    return True
