"""A prompt's model inputs that need no turn of the model, prepared for the next waiting
requests on a second thread while the engine thread steps the running rows.

Two parts of every prefill read only the prompt:
- its positions by the model's own rule (Qwen-VL's M-RoPE walks the prompt's tokens and media
  grids in Python: 0.5-0.7 ms a prompt on the tiny model, several times that on a busy
  machine);
- on a CPU device, its deferred media tensors normalized (:mod:`engine.processing.
  device_normalize`: uint8 patches to float32, 1-5 ms an image or a 16-frame video). On
  another device they are normalized there, after the copy, as before.

On the tiny model under load the engine thread is the server's bottleneck (busy 94% of the
time at concurrency 8), so what leaves it is served sooner. Normalizing runs without the
GIL; the positions' Python takes turns with the engine thread's.

The engine calls :meth:`Prefetcher.schedule` with its waiting requests in order at each step:
the first :attr:`Prefetcher.ahead` get their inputs prepared (bounding the normalized media
held before their prefill to that many prompts). A prefill takes them with
:meth:`Prefetcher.get`: done or under way, it waits for them; not started (or failed), it
computes the positions itself, as without prefetching (so an error raises where a prefill's
errors raise), and normalizes only the media it reads (:meth:`Prefetcher.media`). The
results live on the request (``EngineRequest.inputs``): they go with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.cpus import one_torch_thread_pool
from engine.executor.request import EngineRequest
from engine.processing.preprocess import ProcessedPrompt

#: waiting requests whose inputs are prepared ahead of their prefill
AHEAD = 8

Positions = Callable[[ProcessedPrompt], tuple[Any, int | None]]
Media = Callable[[ProcessedPrompt], dict[str, Any]]


@dataclass
class PromptInputs:
    """A prompt's positions (on the CPU) and rope delta (None without M-RoPE); its media
    tensors as a prefill feeds them (None: not prepared yet, or released after its
    prefill)."""

    positions: Any
    delta: int | None
    media: dict[str, Any] | None = None


class Prefetcher:
    """Prepares :class:`PromptInputs` on one thread of its own (``positions``: a prompt's
    positions and delta; ``media``: its media tensors as fed, None where the device
    normalizes them)."""

    def __init__(self, positions: Positions, media: Media | None,
                 ahead: int | None = None) -> None:
        self._positions = positions
        self._media = media
        self.ahead = AHEAD if ahead is None else ahead
        # (ahead of the prefills, beside the decode steps: one torch thread)
        self._pool = one_torch_thread_pool(1, "aphrodite-prefetch")
        #: prompts whose inputs were ready (or under way) when their prefill asked, and
        #: those computed by the prefill itself
        self.stats = {"prefetched": 0, "inline": 0}

    def schedule(self, requests: Iterable[EngineRequest]) -> None:
        """Prepare the inputs of the first :attr:`ahead` of ``requests`` (waiting, in the
        order they are admitted) that have none yet."""
        for n, request in enumerate(requests):
            if n >= self.ahead:
                return
            if request.inputs is None:
                request.inputs = self._pool.submit(self._prepare, request.prompt)

    def _prepare(self, prompt: ProcessedPrompt) -> PromptInputs:
        positions, delta = self._positions(prompt)
        return PromptInputs(positions, delta,
                            self._media(prompt) if self._media is not None else None)

    def get(self, request: EngineRequest) -> PromptInputs:
        """``request``'s inputs: prepared (waited for when under way), else computed now
        (positions only)."""
        got = request.inputs
        if isinstance(got, Future):
            if got.cancel():  # not started: computed here, now
                got = None
            else:
                try:
                    got = got.result()
                except Exception:  # computed again below, where a prefill's errors raise
                    got = None
        if got is None:
            got = PromptInputs(*self._positions(request.prompt))
            self.stats["inline"] += 1
        elif request.inputs is not got:
            self.stats["prefetched"] += 1
        request.inputs = got
        return got

    def media(self, request: EngineRequest) -> dict[str, Any]:
        """``request``'s media tensors as a prefill feeds them ({} where the device
        normalizes them after the copy)."""
        inputs = self.get(request)
        if inputs.media is None:
            inputs.media = self._media(request.prompt) if self._media is not None else {}
        return inputs.media

    @staticmethod
    def release(request: EngineRequest) -> None:
        """Drop ``request``'s prepared media once its prefill read them, or it ended without
        one (the positions stay: another row of it may be prefilled later); a preparation
        not started is cancelled, one under way drops them when it ends."""
        got = request.inputs
        if isinstance(got, Future):
            if got.cancel():
                request.inputs = None
            else:
                got.add_done_callback(_drop_media)
        elif isinstance(got, PromptInputs):
            got.media = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _drop_media(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().media = None
