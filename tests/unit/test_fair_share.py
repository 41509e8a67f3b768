"""FairSlots (cluster/fair_share.py): a waiter cancelled while it queues never takes a slot, so none leaks.

A client that leaves while its prompt waits for a tokenizer thread cancels its waiter; when a thread freed between
that cancellation and the waiter's task running, the slot once went to the cancelled waiter and was never given
back. On the default pool of 2 threads (one per key) one such cut left the key holding no thread yet unable to start
one: every later request of that key waited for good (tests/serve/test_disconnect.py's storm, about one storm in 30,
and CI's run of 2026-11-28).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.fair_share import FairSlots


def _full(busy: int, queued: int) -> Exception:
    return RuntimeError(f"full: {busy} busy, {queued} queued")


def test_a_waiter_cancelled_just_before_a_slot_frees_takes_none_and_its_tenant_keeps_its_share() -> None:
    async def main() -> None:
        slots = FairSlots(workers=2, queue_limit=4, full=_full)  # one tenant holds at most 1 thread of 2
        await slots.acquire("a")
        waiter = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0)
        assert slots.queued == 1
        waiter.cancel()  # its gate is cancelled now; its task runs later
        slots.release("a")  # the thread frees first
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (slots.busy, slots.queued) == (0, 0)
        await asyncio.wait_for(slots.acquire("a"), 1.0)  # the tenant still gets its thread
        assert slots.running("a") == 1

    asyncio.run(main())


def test_a_waiter_given_its_slot_then_cancelled_hands_it_on() -> None:
    async def main() -> None:
        slots = FairSlots(workers=2, queue_limit=4, full=_full)
        await slots.acquire("a")
        first, second = (asyncio.ensure_future(slots.acquire("a")) for _ in range(2))
        await asyncio.sleep(0)
        slots.release("a")  # `first` is given the thread...
        first.cancel()  # ...and cancelled before it runs: the thread goes on to `second`
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1.0)
        assert (slots.running("a"), slots.queued) == (1, 0)

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(5))
def test_random_cuts_and_ends_leave_every_slot_free(seed: int) -> None:
    """Jobs of three tenants acquire, run a moment and release; a random third are cancelled at a random point
    (while queued, or as their slot is given). Afterwards nothing is held or queued."""
    rng = random.Random(seed)

    async def main() -> None:
        slots = FairSlots(workers=3, queue_limit=1000, full=_full)

        async def job(tenant: str) -> None:
            await slots.acquire(tenant)
            try:
                await asyncio.sleep(rng.choice((0, 0, 0.001)))
            finally:
                slots.release(tenant)

        tasks = []
        for _ in range(300):
            tasks.append(asyncio.ensure_future(job(rng.choice("abc"))))
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            if rng.random() < 0.35:
                rng.choice(tasks).cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        assert (slots.busy, slots.queued) == (0, 0)
        await asyncio.wait_for(asyncio.gather(*(slots.acquire(t) for t in "ab")), 1.0)  # still served
        assert slots.busy == 2

    asyncio.run(main())
