"""The router's admission queue (`router.admission.Admission`) on its own, on an asyncio loop:
clients take turns for freed slots, each client's requests keep their order, a request at the
head of the turn is not overtaken, one client can fill only its share of the queue, and a
cancelled waiter gives its place (or its granted slots) back."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, QueueFull, TooLarge


def run(coro):
    return asyncio.run(coro)


async def queued(adm: Admission, client: str, weight: int, order: list, name: str,
                 tokens: int = 0):
    await adm.acquire(weight, client, tokens)
    order.append(name)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_clients_take_turns_and_keep_their_own_order():
    async def main():
        adm = Admission(max_running=1, max_queue=100)
        await adm.acquire(1, "a")  # the one slot is taken
        order: list[str] = []
        tasks = [asyncio.create_task(queued(adm, "a", 1, order, f"a{i}")) for i in range(4)]
        await settle()
        tasks += [asyncio.create_task(queued(adm, "b", 1, order, f"b{i}")) for i in range(2)]
        tasks.append(asyncio.create_task(queued(adm, "c", 1, order, "c0")))
        await settle()
        assert adm.num_waiting == 7
        for _ in range(7):  # each finished request frees the slot for the next turn
            adm.release(1)
            await settle()
        await asyncio.gather(*tasks)
        # FIFO would give a0 a1 a2 a3 b0 b1 c0: with turns, b and c wait one request each
        assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
        assert adm.num_running == 1 and adm.num_waiting == 0
    run(main())


def test_the_head_of_the_turn_is_not_overtaken():
    async def main():
        adm = Admission(max_running=4, max_queue=10)
        await adm.acquire(3, "a")
        order: list[str] = []
        big = asyncio.create_task(queued(adm, "b", 4, order, "b-big"))
        await settle()
        small = asyncio.create_task(queued(adm, "c", 1, order, "c-small"))  # would fit now
        await settle()
        assert order == []  # it waits behind b's turn
        adm.release(3)
        await settle()
        assert order == ["b-big"]
        adm.release(4)
        await asyncio.gather(big, small)
        assert order == ["b-big", "c-small"]
    run(main())


def test_one_client_fills_only_its_share_of_the_queue():
    async def main():
        adm = Admission(max_running=1, max_queue=6)
        assert adm.max_queue_per_client == 3
        await adm.acquire(1, "flood")
        tasks = [asyncio.create_task(adm.acquire(1, "flood")) for _ in range(3)]
        await settle()
        with pytest.raises(QueueFull, match="its share"):
            await adm.acquire(1, "flood")
        other = asyncio.create_task(adm.acquire(1, "other"))  # room for another client
        await settle()
        assert adm.num_waiting == 4
        for t in tasks + [other]:
            t.cancel()
        await asyncio.gather(*tasks, other, return_exceptions=True)
        assert adm.num_waiting == 0
    run(main())


def test_cancelled_waiters_give_back_their_place_and_slots():
    async def main():
        adm = Admission(max_running=2, max_queue=10)
        await adm.acquire(2, "a")
        order: list[str] = []
        gone = asyncio.create_task(queued(adm, "b", 2, order, "b"))
        later = asyncio.create_task(queued(adm, "c", 1, order, "c"))
        await settle()
        gone.cancel()  # leaves the queue: c's turn comes
        await asyncio.gather(gone, return_exceptions=True)
        adm.release(2)
        await later
        assert order == ["c"] and adm.num_running == 1 and adm.num_waiting == 0
        with pytest.raises(TooLarge, match="--max-running"):
            await adm.acquire(3, "a")
    run(main())


def test_kv_tokens_wait_for_room_beside_those_in_flight():
    """With a KV budget, a request waits until its tokens fit beside those in flight, in the
    same turns (a small request behind a waiting large one does not overtake it); a request
    alone is let in whatever it asks; without a known budget tokens are not counted."""
    async def main():
        budget = [100]
        adm = Admission(max_running=10, max_queue=10, kv_budget=lambda: budget[0])
        assert await adm.acquire(1, "a", 60) == 0.0
        order: list[str] = []
        big = asyncio.create_task(queued(adm, "b", 1, order, "b50", tokens=50))
        await settle()
        small = asyncio.create_task(queued(adm, "c", 1, order, "c10", tokens=10))
        await settle()
        assert order == [] and adm.num_waiting == 2 and adm.kv_running == 60
        adm.release(1, 60)
        await settle()
        assert order == ["b50", "c10"] and adm.kv_running == 60
        adm.release(1, 50)
        adm.release(1, 10)
        assert adm.kv_running == 0 and adm.num_running == 0
        assert await adm.acquire(1, "a", 500) == 0.0  # alone: in, whatever it asks
        adm.release(1, 500)
        budget[0] = None  # the nodes' sizes unknown: only sequences count
        await adm.acquire(1, "a", 500)
        await adm.acquire(1, "b", 500)
        assert adm.kv_running == 1000
        await asyncio.gather(big, small)

    run(main())


def test_a_cancelled_waiter_gives_its_kv_tokens_back():
    async def main():
        adm = Admission(max_running=10, max_queue=10, kv_budget=lambda: 100)
        await adm.acquire(1, "a", 80)
        waiter = asyncio.create_task(adm.acquire(1, "b", 40))
        await settle()
        adm.release(1, 80)  # granted: 40 tokens taken on its behalf ...
        waiter.cancel()  # ... and cancelled before it resumed: they are given back
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.kv_running == 0 and adm.num_running == 0

    run(main())

