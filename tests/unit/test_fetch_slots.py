"""The fetch slots' per-client share, on the event loop: one client waits for its own
slots while another client's requests take the pool's."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import OverloadedError
from engine.server.api.fetch_slots import FetchSlots


async def hold_until(slots: FetchSlots, client: str, release: asyncio.Event,
                     timeout_s: float = 30) -> None:
    loop = asyncio.get_running_loop()
    async with slots.hold(client, loop.time() + timeout_s, timeout_s):
        await release.wait()


async def test_one_client_cannot_hold_more_than_its_share():
    slots, release = FetchSlots(total=4, per_client=2), asyncio.Event()
    loop = asyncio.get_running_loop()
    held = [asyncio.create_task(hold_until(slots, "10.0.0.9", release)) for _ in range(2)]
    await asyncio.sleep(0)
    # A third request of the same client waits for its own share, not the pool's two free
    # slots, and gets the 503 naming the per-client flag at its deadline.
    with pytest.raises(OverloadedError) as info:
        async with slots.hold("10.0.0.9", loop.time() + 0.2, 0.2):
            pass
    assert info.value.status == 503 and info.value.code == "fetch_slots_busy"
    assert "--max-fetches-per-client" in info.value.hint
    # Another client takes both free slots at once.
    async with (slots.hold("10.0.0.7", loop.time() + 0.2, 0.2),
                slots.hold("10.0.0.7", loop.time() + 0.2, 0.2)):
        # Now the pool is full: the next client waits for the pool, and its 503 names the
        # pool's flag.
        with pytest.raises(OverloadedError) as info:
            async with slots.hold("10.0.0.8", loop.time() + 0.2, 0.2):
                pass
        assert "--max-concurrent-fetches" in info.value.hint
    release.set()
    await asyncio.gather(*held)
    assert slots.clients == 0  # the table holds only clients with a request in flight


async def test_a_waiting_request_takes_its_clients_slot_when_one_frees():
    slots, release = FetchSlots(total=4, per_client=1), asyncio.Event()
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(hold_until(slots, "a", release))
    await asyncio.sleep(0)
    second = asyncio.create_task(hold_until(slots, "a", asyncio.Event(), timeout_s=5))
    await asyncio.sleep(0.05)
    assert not second.done() and slots.clients == 1
    release.set()
    await first
    await asyncio.sleep(0.05)  # the second now holds the slot (it waits on its own event)
    with pytest.raises(OverloadedError):
        async with slots.hold("a", loop.time() + 0.1, 0.1):
            pass
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert slots.clients == 0
    async with slots.hold("a", loop.time() + 0.1, 0.1):  # every slot was given back
        pass


async def test_zero_means_no_share_and_the_pool_is_the_only_limit():
    slots, release = FetchSlots(total=3, per_client=0), asyncio.Event()
    held = [asyncio.create_task(hold_until(slots, "a", release)) for _ in range(3)]
    await asyncio.sleep(0)
    assert slots.clients == 0
    loop = asyncio.get_running_loop()
    with pytest.raises(OverloadedError) as info:
        async with slots.hold("b", loop.time() + 0.1, 0.1):
            pass
    assert "--max-concurrent-fetches" in info.value.hint
    release.set()
    await asyncio.gather(*held)


async def test_a_client_waits_for_at_most_its_share_then_is_refused_at_once():
    """Waiting requests hold places in the decode queue in front of the slots: one client may
    have its share fetching and as many waiting, no more."""
    slots, release = FetchSlots(total=8, per_client=2), asyncio.Event()
    loop = asyncio.get_running_loop()
    held = [asyncio.create_task(hold_until(slots, "a", release)) for _ in range(4)]
    await asyncio.sleep(0.05)  # two hold, two wait
    started = loop.time()
    with pytest.raises(OverloadedError) as info:
        async with slots.hold("a", loop.time() + 30, 30):
            pass
    assert loop.time() - started < 5  # refused at once, not at its 30 s deadline
    assert "--max-fetches-per-client" in info.value.hint
    async with slots.hold("b", loop.time() + 1, 1):  # another client is not affected
        pass
    release.set()
    await asyncio.gather(*held)
    assert slots.clients == 0


@pytest.mark.parametrize(("peer", "key"), [
    ("10.0.0.1", "10.0.0.1"), ("::ffff:10.0.0.1", "10.0.0.1"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"), (None, ""), ("unix", "unix")])
def test_an_ipv6_client_is_its_64(peer, key):
    from engine.server.api.fetch_slots import client_key

    assert client_key(peer) == key
