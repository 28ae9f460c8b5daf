"""The GPU decode budget: waiting, first come first served, oversize, division among
processes, release on error. Pure asyncio: no GPU needed."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import ConfigError, MediaTooLargeError
from engine.media.video.budget import GIB, GpuDecodeBudget


def test_division_among_api_servers():
    budget = GpuDecodeBudget.from_gb(8, api_server_count=4)
    assert budget.share_bytes == 2 * GIB and budget.reserved_total_bytes == 8 * GIB
    with pytest.raises(ConfigError):
        GpuDecodeBudget.from_gb(0)
    with pytest.raises(ConfigError):
        GpuDecodeBudget.from_gb(1, api_server_count=0)


async def test_oversize_item_is_a_client_error_naming_the_flag():
    budget = GpuDecodeBudget(1000, api_server_count=2)
    with pytest.raises(MediaTooLargeError) as info:
        await budget.acquire(501)
    assert info.value.status == 413 and "--mm-ipc-gpu-memory-gb" in info.value.hint
    assert budget.in_use == 0


async def test_waits_when_exhausted_and_resumes_on_release():
    budget = GpuDecodeBudget(100)
    await budget.acquire(80)
    waiter = asyncio.create_task(budget.acquire(50))
    await asyncio.sleep(0.01)
    assert not waiter.done() and budget.waiting == 1
    budget.release(80)
    await asyncio.wait_for(waiter, 1)
    assert budget.in_use == 50


async def test_first_come_first_served():
    """A small request behind a big one waits its turn even when it would fit now."""
    budget = GpuDecodeBudget(100)
    await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    big = asyncio.create_task(take("big", 70))
    await asyncio.sleep(0.01)
    small = asyncio.create_task(take("small", 10))
    await asyncio.sleep(0.01)
    assert order == []  # small (10) would fit beside 60, but big came first
    budget.release(60)
    await asyncio.wait_for(asyncio.gather(big, small), 1)
    assert order == ["big", "small"] and budget.in_use == 80


async def _until(condition) -> None:
    """Let other tasks run until ``condition()`` holds (a few loop turns; bounded)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_released_on_error_and_on_cancellation():
    """What a decode holds comes back when it fails, when its task is cancelled while
    holding, and when it is cancelled just after being granted (before it resumed)."""
    budget = GpuDecodeBudget(100)
    with pytest.raises(RuntimeError):
        async with budget.reserve(40):
            assert budget.in_use == 40
            raise RuntimeError("decoder crashed")
    assert budget.in_use == 0

    holding = asyncio.Event()

    async def hold() -> None:
        async with budget.reserve(60):
            holding.set()
            await asyncio.Event().wait()  # until cancelled

    holder = asyncio.create_task(hold())
    await holding.wait()
    assert budget.in_use == 60
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert budget.in_use == 0

    await budget.acquire(100)
    waiter = asyncio.create_task(budget.acquire(30))
    await _until(lambda: budget.waiting == 1)
    budget.release(100)  # grants the waiter its 30 bytes...
    assert budget.in_use == 30 and not waiter.done()
    waiter.cancel()      # ...but it is cancelled before it runs again: it must give them back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.in_use == 0 and budget.waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue_at_once():
    """A cancelled request at the head of the queue stops blocking the ones behind it
    immediately, not at the next release."""
    budget = GpuDecodeBudget(100)
    await budget.acquire(60)
    big = asyncio.create_task(budget.acquire(70))
    await _until(lambda: budget.waiting == 1)
    small = asyncio.create_task(budget.acquire(10))  # fits beside 60, but big is first
    await _until(lambda: budget.waiting == 2)
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    # No release happens: only leaving the queue can let small in. The generous timeout only
    # bounds how long a broken build takes to fail (a passing run takes one loop turn).
    await asyncio.wait_for(small, 10)
    assert budget.in_use == 70 and budget.waiting == 0
