"""The failover wait learned from the starts the router sees (cluster/start_times.py), and the router waiting that
long, not a fixed guess, for a failed instance's replacement (issue 40: a 60 s wait lost every stream where a start
took 63 s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.config import ConfigError, FailoverConfig, RouterConfig, parse_config
from cluster.registry import NoInstanceAvailable
from cluster.router import Router
from cluster.start_times import StartHistory


def test_the_wait_is_a_multiple_of_the_slowest_recent_start_within_floor_and_ceiling() -> None:
    h = StartHistory(floor_s=5.0, ceiling_s=100.0, multiple=2.0, window=3)
    assert (h.wait().wait_s, h.wait().slowest_s) == (5.0, None)  # nothing seen: the floor
    h.registered("i0", "a", now=0.0, start_s=1.0)
    assert h.wait().wait_s == 5.0  # 2 x 1 s is below the floor
    h.registered("i0", "a", now=1.0, start_s=40.0)  # the same incarnation again (the router restarted): no news
    assert h.wait().samples == 1 and h.wait().wait_s == 5.0
    h.lost("i0", now=10.0)
    h.registered("i0", "b", now=40.0, start_s=20.0)  # its replacement: a start of 20 s, registered 30 s after loss
    assert (h.wait().slowest_s, h.wait().wait_s, h.wait().samples) == (30.0, 60.0, 3)
    for n in range(3):  # the window keeps the last 3: the slow ones age out
        h.registered(f"j{n}", "x", now=50.0, start_s=3.0)
    assert (h.wait().slowest_s, h.wait().wait_s) == (3.0, 6.0)
    h.registered("k", "y", now=60.0, start_s=500.0)
    assert h.wait().wait_s == 100.0  # the ceiling


def test_the_floor_may_not_exceed_the_ceiling() -> None:
    with pytest.raises(ValueError, match="floor"):
        StartHistory(floor_s=10.0, ceiling_s=5.0)
    with pytest.raises(ConfigError, match="max_wait_s"):
        parse_config({"router": {"failover": {"wait_s": 700}}}, source="test")
    assert FailoverConfig().max_wait_s >= FailoverConfig().wait_s


def test_the_router_waits_as_long_as_a_start_it_saw_took_then_names_the_wait_when_it_runs_out() -> None:
    """Floor 0.3 s; the instance's start took 1 s, so a request waits up to 2 s: a replacement that registers 1 s
    after the loss (past the floor) still takes it. With no start seen, the floor, and an error naming it."""
    cfg = RouterConfig(failover=FailoverConfig(wait_s=0.3, max_wait_s=30.0, start_multiple=2.0), stats_interval_s=60.0)

    async def scenario() -> None:
        router = Router(cfg)
        began = time.monotonic()
        with pytest.raises(NoInstanceAvailable, match=r"failover wait of 0\.\d s \(the configured floor"):
            await router.route("r0")
        assert 0.3 <= time.monotonic() - began < 2.0

        handle = object()
        await router.register("i0", handle, "m", 64, "node", incarnation="a", start_s=1.0)
        assert (await router.failover_wait()).wait_s == pytest.approx(2.0)
        router.health.remove_failed("i0", "killed")  # as the poll does when an instance stops answering

        async def replacement() -> None:
            await asyncio.sleep(1.0)
            await router.register("i0", handle, "m", 64, "node", incarnation="b", start_s=0.5)

        began = time.monotonic()
        (instance, got), _ = await asyncio.gather(router.route("r1"), replacement())
        assert instance == "i0" and got is handle and time.monotonic() - began >= 1.0
        wait = await router.failover_wait()
        assert wait.slowest_s == pytest.approx(1.0, abs=0.5) and wait.samples == 3

    asyncio.run(scenario())


def test_an_announced_start_is_waited_for_past_the_learned_wait_up_to_the_ceiling() -> None:
    """A start slower than any seen before (a loaded machine): the replica announced it, so a waiting request waits
    for its registration past the learned wait (floor 0.3 s here, nothing learned), never past the ceiling."""
    cfg = RouterConfig(failover=FailoverConfig(wait_s=0.3, max_wait_s=1.5), stats_interval_s=60.0)

    async def scenario() -> None:
        router = Router(cfg)
        handle = object()
        await router.starting("i0")
        assert (await router.failover_wait()).starting == 1

        async def slow_start() -> None:
            await asyncio.sleep(0.9)
            await router.register("i0", handle, "m", 64, "node", incarnation="a", start_s=0.9)

        began = time.monotonic()
        (instance, _), _ = await asyncio.gather(router.route("r0"), slow_start())
        assert instance == "i0" and time.monotonic() - began >= 0.9
        assert (await router.failover_wait()).starting == 0
        router.health.remove_failed("i0", "killed")
        await router.starting("i0")  # a replacement that never registers: the ceiling ends the wait
        began = time.monotonic()
        with pytest.raises(NoInstanceAvailable, match="failover wait"):
            await router.route("r1")
        assert 1.5 <= time.monotonic() - began < 3.0

    asyncio.run(scenario())


def test_the_last_start_is_reported_phase_by_phase() -> None:
    """`specfleet status` shows where the last start went (actors/start_phases.py), as its instance reported it."""
    h = StartHistory(floor_s=10.0, ceiling_s=300.0)
    assert h.wait().last_start == ()
    first = (("replica", 0.2), ("process", 1.0), ("weights", 0.5), ("layout", 0.9))
    h.registered("i0", "a", now=100.0, start_s=2.7, phases=first)
    assert h.wait().last_start == first
    h.registered("i0", "a", now=150.0, start_s=9.9, phases=(("weights", 9.9),))  # the router restarted: same start
    assert h.wait().last_start == first
    h.lost("i0", now=200.0)
    h.registered("i0", "b", now=205.0, start_s=3.0, phases=(("process", 3.0),))
    assert h.wait().last_start == (("process", 3.0),)
