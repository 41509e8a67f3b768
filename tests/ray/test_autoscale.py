"""SLO autoscaling on the real local cluster: the autoscaler (deploy/serve/autoscaler.py) scales out under load with
an instance planned and started as the deployed fleet's are, and scales in by draining through live migration.
Every stream completes with the output of an unscaled run (temperature 0), none fails over, and nothing leaks: the
router's table and pending count, the KV blocks of the instance that stays and of the one that left."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import ray

from actors.serving.server import InstanceServer
from ray.exceptions import ActorDiedError

from cluster.config import RouterConfig, SpecfleetConfig, parse_config
from cluster.request import FinishReason
from cluster.router import INSTANCE_ACTOR_PREFIX, NAMESPACE, Router
from cluster.router_client import RouterClient
from deploy.serve.autoscaler import Autoscaler, PlannedLauncher
from deploy.serve.fleet import fleet_specs
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from deploy.serve.metrics import Metrics
from tests.ray.test_migration import HOLD_S, Fleet, Streamed, held, kv_free, stream, wait_no_pending
from tests.unit.helpers import load, text_prompts

TOKENS = 100
SLOTS = 2


def config(target, draft) -> SpecfleetConfig:
    return parse_config({
        "engine": {"model": {"target": str(target), "draft": str(draft), "name": "tiny-llama"},
                   "speculation": {"policy": "fixed", "k": 3}, "scheduler": {"max_batch_size": SLOTS},
                   "cache": {"block_size": 4, "num_blocks": 256}},
        "fleet": {"instance_num_cpus": 0.5,
                  "autoscaling": {"min_instances": 1, "max_instances": 2, "up_after_s": 0, "down_after_s": 0,
                                  "cooldown_s": 0, "interval_s": 0.2,
                                  "target": {"queue_per_instance": 1}}},
        "router": {"stats_interval_s": 0.2},
    })


@pytest.fixture(scope="module")
def scaled(ray_driver, tiny_models, tiny_draft_models):
    """The deployed floor (one instance, planned by `fleet_specs` as build_app plans it) behind a router, a frontend,
    and an autoscaler whose launcher plans and starts more the same way."""
    cfg = config(tiny_models["llama"], tiny_draft_models["llama"])
    [spec] = fleet_specs(cfg)
    router = ray.remote(Router).options(max_concurrency=100, num_cpus=0).remote(cfg.router)
    fl = Fleet(router, Frontend(frontend_config(cfg), router), cfg=cfg.engine)
    server = InstanceServer.spawn(spec)
    info = ray.get(server.info.remote(), timeout=300)
    ray.get(router.register.remote(spec.instance_id, server, info.model, info.max_model_len, info.node_id, spec.place,
                                   info.actor_id))
    fl.servers[spec.instance_id] = server
    autoscaler = Autoscaler(cfg.fleet.autoscaling, SLOTS, RouterClient(router), PlannedLauncher(spec, cfg.fleet))
    try:
        yield fl, autoscaler, spec.instance_id
    finally:
        autoscaler.stop_all()
        for s in fl.servers.values():
            ray.kill(s)
        ray.kill(router)


def test_scale_out_under_load_and_in_through_migration_loses_no_stream(scaled) -> None:
    fl, autoscaler, floor = scaled
    prompts = text_prompts(load(fl.cfg.model.target), 8, offset=3)

    async def unscaled() -> list[Streamed]:
        return await asyncio.gather(*(stream(fl, p, tokens=TOKENS) for p in prompts))

    alone = asyncio.run(unscaled())
    assert [len(s.tokens) for s in alone] == [TOKENS] * 8 and {s.instance for s in alone} == {floor}
    wait_no_pending(fl)
    decisions, scale_in = [], []

    async def scaled_run() -> list[Streamed]:
        first = [asyncio.create_task(stream(fl, p, tokens=TOKENS)) for p in prompts[:4]]
        # 4 requests on 2 slots: 2 queued on the one instance, above the target of 1: the autoscaler adds one
        for _ in range(100):
            await asyncio.sleep(0.2)
            decisions.append(await autoscaler.tick())
            if decisions[-1].action == "up":
                break
        assert decisions[-1].action == "up" and "queue" in decisions[-1].reason, decisions
        added = autoscaler.events[-1]
        assert (added.action, added.outcome) == ("up", "done"), added
        fl.servers[added.instance_id] = autoscaler.servers[added.instance_id]
        # held: no stream can end before the drain moves what runs on the new instance (which it then stops)
        async with held(fl, floor), _paused(fl.servers[added.instance_id]):
            second = [asyncio.create_task(stream(fl, p, tokens=TOKENS)) for p in prompts[4:]]
            while not await _on(fl, added.instance_id):  # the newcomer, empty, gets new requests first
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the rest of the second wave is routed
            # falling load, forced: the same step the policy's "down" takes
            scale_in.append(await autoscaler.scale_in(added.instance_id, "test: forced drain"))
        return await asyncio.gather(*first, *second)

    moved = asyncio.run(scaled_run())

    [event] = scale_in
    assert (event.action, event.outcome, event.detail) == ("down", "done", ""), event  # detail: no KV left on it
    assert event.migrated >= 1
    assert [m.finish for m in moved] == [FinishReason.LENGTH] * 8
    for m, a in zip(moved, alone):  # every stream complete, token for token the unscaled run's
        assert (m.tokens, m.text) == (a.tokens, a.text)
    stats = ray.get(fl.router.migration_stats.remote())
    assert stats.failovers == 0 and stats.by_status["finished"] >= event.migrated  # moved live, never restarted
    wait_no_pending(fl)
    rows = ray.get(fl.router.instances.remote())
    assert [r.instance_id for r in rows] == [floor]  # the one that left is out of the router's table
    fl.servers.pop(event.instance_id)
    kv_free(fl)
    # the load gone, at min_instances: the autoscaler holds
    d = asyncio.run(autoscaler.tick())
    assert d.action == "hold" and d.desired == 1, d
    assert [(e.action, e.outcome) for e in autoscaler.events] == [("up", "done"), ("down", "done")]


async def _on(fl: Fleet, instance_id: str) -> int:
    rows = await fl.router.instances.remote()
    return next((r.in_flight for r in rows if r.instance_id == instance_id), 0)


@contextlib.asynccontextmanager
async def _paused(server):
    """`held` for an instance that may be stopped inside: resumed after, unless it is gone."""
    await server.pause.remote(HOLD_S)
    try:
        yield
    finally:
        with contextlib.suppress(ActorDiedError):
            await server.resume.remote()


def test_a_restarted_router_gives_an_autoscaled_instance_its_role_back(scaled) -> None:
    """A router rebuilds its table from the instance actors it finds by name (cluster/router.py `_rebuild`): the one
    started for a router found gone for good, and the same router's process restarted by Ray. An instance the
    autoscaler added as `decode` comes back `decode` in both, not `both`: it reports the role its spec gave it."""
    fl, autoscaler, floor = scaled
    rows = ray.get(fl.router.instances.remote())
    [event] = asyncio.run(autoscaler.scale_out("test: a decode instance", rows, "decode"))
    assert (event.action, event.outcome) == ("up", "done"), event
    added = event.instance_id
    assert {r.instance_id: r.role for r in ray.get(fl.router.instances.remote())}[added] == "decode"
    restarted = ray.remote(Router).options(max_concurrency=100, num_cpus=0, max_restarts=1,
                                           max_task_retries=-1).remote(RouterConfig(stats_interval_s=0.2),
                                                                       discover=True)
    try:
        roles = {r.instance_id: r.role for r in ray.get(restarted.instances.remote(), timeout=120)}
        assert roles.get(added) == "decode", roles  # the floor was started unnamed: no router finds it
        ray.kill(restarted, no_restart=False)  # its process dies; Ray starts it again, and it rebuilds again
        roles = {r.instance_id: r.role for r in ray.get(restarted.instances.remote(), timeout=120)}
        assert roles.get(added) == "decode", roles
    finally:
        ray.kill(restarted)
    out = asyncio.run(autoscaler.scale_in(added, "test: back to the floor"))
    assert (out.action, out.outcome) == ("down", "done"), out
    assert [r.instance_id for r in ray.get(fl.router.instances.remote())] == [floor]


def test_a_step_of_two_plans_each_on_a_device_of_its_own_and_one_without_room_fails_cleanly(scaled) -> None:
    """A proportional step of two, started side by side, on a test cluster with one free device left: the launches
    share what they take, so one starts there and the other is refused for lack of room (recorded as a failed
    step), never planned onto the same device; the one started serves, and `scale_in_all` takes it back out."""
    fl, autoscaler, floor = scaled
    rows = ray.get(fl.router.instances.remote())
    events = asyncio.run(autoscaler.scale_out("test: two at once", rows, count=2))
    assert sorted(e.outcome for e in events) == ["done", "failed"], events
    [done] = [e for e in events if e.outcome == "done"]
    [refused] = [e for e in events if e.outcome == "failed"]
    assert "PlacementError" in refused.detail and "held by another instance" in refused.detail, refused
    assert refused.instance_id not in autoscaler.servers  # nothing of it is left running
    rows = {r.instance_id: r for r in ray.get(fl.router.instances.remote())}
    assert set(rows) == {floor, done.instance_id}
    held_by = [rows[i].place.places for i in (floor, done.instance_id)]
    assert held_by[0].isdisjoint(held_by[1]), held_by
    prompt = text_prompts(load(fl.cfg.model.target), 1, offset=13)[0]
    fl.servers[done.instance_id] = autoscaler.servers[done.instance_id]
    out = asyncio.run(stream(fl, prompt, tokens=8))
    assert len(out.tokens) == 8
    [back] = asyncio.run(autoscaler.scale_in_all((done.instance_id,), "test: back to the floor"))
    assert (back.action, back.outcome, back.detail) == ("down", "done", ""), back
    fl.servers.pop(done.instance_id)
    wait_no_pending(fl)
    assert [r.instance_id for r in ray.get(fl.router.instances.remote())] == [floor]


@ray.remote(num_cpus=0)
class _Replica:
    """Stands in for the autoscaler's Serve replica: an autoscaler in a process of its own, which can die."""

    def __init__(self, cfg: SpecfleetConfig, spec, router) -> None:
        self.autoscaler = Autoscaler(cfg.fleet.autoscaling, SLOTS, RouterClient(router),
                                     PlannedLauncher(spec, cfg.fleet))

    async def scale_out(self, rows):
        return await self.autoscaler.scale_out("test: started by a replica that dies", rows)


def test_an_instance_outlives_the_autoscaler_that_started_it_and_the_next_one_adopts_it(scaled) -> None:
    """The autoscaler's replica dies (Serve would replace it): the instance it started is detached, so it lives on,
    registered and serving, and the autoscaler that takes over adopts it, scales it in through migration, and would
    stop it with the app."""
    fl, autoscaler, floor = scaled
    cfg = config(fl.cfg.model.target, fl.cfg.model.draft)
    [spec] = fleet_specs(cfg)
    replica = _Replica.remote(cfg, spec, fl.router)
    [event] = ray.get(replica.scale_out.remote(ray.get(fl.router.instances.remote())), timeout=300)
    assert (event.action, event.outcome) == ("up", "done"), event
    added = event.instance_id
    ray.kill(replica)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(replica.scale_out.remote([]), timeout=60)
    [named] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"{INSTANCE_ACTOR_PREFIX}{added}/")]
    server = ray.get_actor(named, namespace=NAMESPACE)
    try:
        time.sleep(1.0)  # several of the router's health rounds (0.2 s)
        assert ray.get(server.info.remote(), timeout=30).model
        assert {r.instance_id: r.healthy for r in ray.get(fl.router.instances.remote())}.get(added), added
        fl.servers[added] = server
        prompt = text_prompts(load(fl.cfg.model.target), 1, offset=17)[0]
        assert len(asyncio.run(stream(fl, prompt, tokens=8)).tokens) == 8
        taking_over = Autoscaler(cfg.fleet.autoscaling, SLOTS, RouterClient(fl.router),
                                 PlannedLauncher(spec, cfg.fleet))
        assert asyncio.run(taking_over.adopt(ray.get(fl.router.instances.remote()))) == [added]
        assert added in taking_over.servers
        out = asyncio.run(taking_over.scale_in(added, "test: back to the floor"))
        assert (out.action, out.outcome) == ("down", "done"), out
        fl.servers.pop(added)
        assert [r.instance_id for r in ray.get(fl.router.instances.remote())] == [floor]
    finally:
        ray.kill(server)  # detached: nothing else would


def test_each_failed_autoscaling_round_is_counted_and_autoscaling_goes_on(ray_driver, tiny_models,
                                                                          tiny_draft_models) -> None:
    """The router killed for good, and no way to find it again: every round raises. The loop goes on, and each
    failed round counts in the autoscaler's status and /metrics (not only in its log)."""
    cfg = config(tiny_models["llama"], tiny_draft_models["llama"])
    [spec] = fleet_specs(cfg)
    router = ray.remote(Router).options(num_cpus=0).remote(cfg.router)
    ray.get(router.pending.remote(), timeout=60)
    ray.kill(router)
    autoscaler = Autoscaler(cfg.fleet.autoscaling, SLOTS, RouterClient(router, reconnect_s=0.3),
                            PlannedLauncher(spec, cfg.fleet))

    async def run_a_while() -> None:
        loop = asyncio.create_task(autoscaler.run())
        for _ in range(100):
            if autoscaler.status().failed_rounds >= 2:
                break
            await asyncio.sleep(0.1)
        assert not loop.done()  # it goes on after the failed rounds
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop

    asyncio.run(run_a_while())
    status = autoscaler.status()
    assert status.failed_rounds >= 2 and status.last_failure.startswith("ActorDiedError"), status
    assert not autoscaler.events  # nothing was started or stopped
    metrics = Metrics("tiny-llama")
    metrics.autoscale_figures = status
    assert f"specfleet:autoscaling_failed_rounds_total {float(status.failed_rounds)}" in metrics.render().decode()
