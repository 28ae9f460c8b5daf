"""An API server's connections to several data-parallel engine processes
(``serve --data-parallel-size N``), behind
:class:`~engine.server.process.engine_client.EngineClient`'s
interface: each request goes to one engine, chosen by cache affinity within a load bound.

Each engine keeps its own prefix and encoder caches, so a request should go where its prefix
was computed before. Requests are told apart by an **affinity key** (the content key of their
first media item; a text-only prompt: its first :data:`AFFINITY_TOKENS` tokens): the same
question about the same image, another question about it, a conversation's next turn share
one. A key seen before goes to the engine its last request went to (each API server
remembers the last :data:`AFFINITY_MEMORY` keys) while that engine has at most
:data:`BALANCE_SLACK` more requests in flight than the least busy one: a miss costs the
encoder and a whole prefill, a few more rows in a decode step cost little. Past that bound,
and for a new key, the least busy engine takes the request (among equals, the one the key
hashes to, so keys sent one at a time spread over the engines), and the key's next request
follows it there, where its keys and values now are (as SGLang's cache-aware router balances
against its own thresholds; vLLM's internal data-parallel balancer picks the least
loaded engine only). Loads are counted per API server: each routes its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from engine.config import BALANCE_SLACK  # (--data-parallel-size's help reads it)
from engine.server.process.engine_client import EngineClient

#: prompt tokens a text-only prompt's affinity key covers
AFFINITY_TOKENS = 64
#: affinity keys an API server remembers the engine of (the least recently used go first;
#: about 100 bytes each)
AFFINITY_MEMORY = 1 << 16


def affinity_key(input_ids: list[int], mm_hashes: list[str]) -> bytes:
    """What a request's engine is chosen by (16 bytes): a digest of its first media item's
    content key, else of its first AFFINITY_TOKENS prompt tokens."""
    if mm_hashes:
        named = f"mm:{mm_hashes[0]}".encode()
    else:
        named = b"ids:" + b",".join(str(t).encode() for t in input_ids[:AFFINITY_TOKENS])
    return hashlib.blake2b(named, digest_size=16).digest()


def preferred(key: bytes, engines: int) -> int:
    """The engine ``key`` hashes to (the same in every API server and every run)."""
    return int.from_bytes(key[:8], "big") % engines


def pick(held: int | None, hashed: int, loads: list[int], slack: int = BALANCE_SLACK) -> int:
    """``held`` (the engine holding the key's prefix; None: a new key) unless it has more
    than ``slack`` requests in flight over the least busy engine; else the least busy one,
    ``hashed`` (where the key hashes to) among equals, then the lowest index."""
    least = min(loads)
    if held is not None and loads[held] - least <= slack:
        return held
    return hashed if loads[hashed] == least else loads.index(least)


def merge_stats(answers: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The engines' numbers for /metrics as one engine's: counts and bytes summed, the
    ``*_max`` ones the largest; None when any engine did not answer (its share unknown)."""
    if not answers or any(a is None for a in answers):
        return None
    merged: dict[str, float] = {}
    for answer in answers:
        for name, value in answer.items():  # type: ignore[union-attr]
            if name not in merged:
                merged[name] = value
            elif name.endswith("_max"):
                merged[name] = max(merged[name], value)
            else:
                merged[name] += value
    return merged


class EnginePool:
    """Several engines' clients, used as one (see the module's text)."""

    def __init__(self, clients: list[EngineClient]) -> None:
        self.clients = clients
        #: requests in flight on each engine, from this API server
        self.loads = [0] * len(clients)
        #: requests sent to each engine so far, from this API server (for /metrics)
        self.routed = [0] * len(clients)
        #: called when an engine passes a processor cache reset on (one list for all)
        self.on_reset_mm_cache: list = []
        #: the engine each affinity key's last request went to, least recently used first
        self._placed: OrderedDict[bytes, int] = OrderedDict()
        for client in clients:
            client.on_reset_mm_cache = self.on_reset_mm_cache

    @property
    def alive(self) -> bool:
        return all(client.alive for client in self.clients)

    def choose(self, input_ids: list[int], mm_hashes: list[str]) -> int:
        """The engine a request goes to (see the module's text), remembered for its key."""
        key = affinity_key(input_ids, mm_hashes)
        index = pick(self._placed.get(key), preferred(key, len(self.clients)), self.loads)
        self._placed[key] = index
        self._placed.move_to_end(key)
        if len(self._placed) > AFFINITY_MEMORY:
            self._placed.popitem(last=False)
        return index

    async def generate(self, input_ids: list[int], mm: dict[str, Any],
                       sampling: dict[str, Any],
                       mm_items: tuple[list[str], list[tuple[int, int]]] = ([], []),
                       *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """:meth:`EngineClient.generate` on the engine :meth:`choose` picks."""
        index = self.choose(input_ids, list(mm_items[0]))
        self.loads[index] += 1
        self.routed[index] += 1
        inner = self.clients[index].generate(input_ids, mm, sampling, mm_items, *args, **kwargs)
        try:
            async with contextlib.aclosing(inner):  # closed with this one: it cancels there
                async for message in inner:
                    yield message
        finally:
            self.loads[index] -= 1

    async def stats(self, timeout_s: float = 2.0) -> dict[str, float] | None:
        """Every engine's numbers, merged (see :func:`merge_stats`)."""
        return merge_stats(list(await asyncio.gather(
            *(client.stats(timeout_s) for client in self.clients))))

    async def reset(self, what: str, timeout_s: float = 40.0) -> dict[str, Any] | None:
        """A cache reset on every engine (``mm``: each empties its encoder cache, and every
        API server is told to clear its processor cache once per engine); one answer, None
        when an engine did not answer."""
        answers = await asyncio.gather(*(c.reset(what, timeout_s) for c in self.clients))
        if any(a is None for a in answers):
            return None
        merged: dict[str, Any] = {"reset": all(a.get("reset") for a in answers),  # type: ignore[union-attr]
                                  "engines": len(answers)}
        for answer in answers:
            for name, value in answer.items():  # type: ignore[union-attr]
                if name == "reset":
                    continue
                if name == "api_servers":  # each engine told the same API servers
                    merged[name] = max(merged.get(name, 0), value)
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    merged[name] = merged.get(name, 0) + value
                else:
                    merged.setdefault(name, value)
        return merged

    def close(self) -> None:
        for client in self.clients:
            client.close()
