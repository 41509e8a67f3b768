"""The unauthenticated routes' fleet view is fetched once per second per replica, whatever the rate of hits."""

from __future__ import annotations

import asyncio

import pytest

from deploy.serve.cached import Cached


def test_many_hits_make_one_router_call_per_ttl_and_errors_are_not_kept() -> None:
    calls, now = [], [0.0]

    async def fetch() -> int:
        calls.append(now[0])
        await asyncio.sleep(0.01)  # concurrent hits arrive while it is under way
        if len(calls) == 3:
            raise RuntimeError("the router is down")
        return len(calls)

    async def run() -> None:
        view = Cached(fetch, ttl_s=1.0, clock=lambda: now[0])
        assert await asyncio.gather(*(view.get() for _ in range(50))) == [1] * 50
        now[0] = 0.9
        assert await view.get() == 1 and len(calls) == 1
        now[0] = 1.5
        assert await view.get() == 2
        now[0] = 3.0
        with pytest.raises(RuntimeError):
            await view.get()
        assert await view.get() == 4  # the failure was not kept

    asyncio.run(run())


def test_a_change_made_through_this_replica_shows_at_once() -> None:
    state = {"healthy": 2}

    async def fetch() -> int:
        return state["healthy"]

    async def run() -> None:
        view = Cached(fetch, ttl_s=60.0)
        assert await view.get() == 2
        state["healthy"] = 1  # an undrain through this replica's /admin
        assert await view.get() == 2  # within the second: the cached answer
        view.invalidate()
        assert await view.get() == 1

    asyncio.run(run())
