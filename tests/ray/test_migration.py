"""Live migration, migrating drains and failover on the real local cluster: instance actors, a router, and the API's
frontend in this process, whose streams follow a request wherever it goes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import ray

from actors.serving.server import InstanceServer
from cluster.config import (CacheConfig, EngineConfig, MigrationConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpecfleetConfig, SpeculationConfig)
from cluster.instances import DrainResult, RequestRow
from cluster.migration_policy import MigrationPolicyConfig
from cluster.request import FinishReason
from cluster.router import Router
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot
from tests.fixtures.tiny_models import build_tiny_model, perturbed_copy
from tests.ray.test_instance_server import CPUS, LAYOUTS
from tests.unit.helpers import load, text_prompts

TOKENS = 600  # long enough (several hundred engine steps) that a stream is still running when its event lands
# the longest the instances are held between two steps (`held`), should a test fail before it resumes them
HOLD_S = 120.0


@dataclass
class Fleet:
    router: ray.actor.ActorHandle
    frontend: Frontend
    servers: dict[str, ray.actor.ActorHandle] = field(default_factory=dict)
    cfg: EngineConfig | None = None

    def start(self, instance_id: str, executor: str = "local", layout: ShardLayout | None = None) -> None:
        spec = InstanceSpec(instance_id=instance_id, layout=layout or LAYOUTS[executor], executor=executor,
                            num_cpus=CPUS, engine=self.cfg)
        server = InstanceServer.spawn(spec)
        info = ray.get(server.info.remote(), timeout=300)
        ray.get(self.router.register.remote(instance_id, server, info.model, info.max_model_len, info.node_id))
        self.servers[instance_id] = server


@pytest.fixture(scope="module")
def fleet(ray_driver, tmp_path_factory) -> Iterator[Fleet]:
    """Two instances of a tiny llama with a long context (and its perturbed copy as draft), a router, a frontend."""
    root = tmp_path_factory.mktemp("long-llama")
    target = build_tiny_model("llama", root / "target", max_position_embeddings=2048)
    draft = perturbed_copy(target, root / "draft", 0.02)
    cfg = EngineConfig(model=ModelConfig(target=str(target), draft=str(draft), name="long-llama"),
                       speculation=SpeculationConfig(policy="fixed", k=3), scheduler=SchedulerConfig(max_batch_size=8),
                       cache=CacheConfig(block_size=16, num_blocks=1024))
    router = ray.remote(Router).options(max_concurrency=100, num_cpus=0).remote(RouterConfig(stats_interval_s=0.2))
    fl = Fleet(router, Frontend(frontend_config(SpecfleetConfig(engine=cfg)), router), cfg=cfg)
    try:
        for name in ("mig-a", "mig-b"):
            fl.start(name)
        yield fl
    finally:
        for server in fl.servers.values():
            ray.kill(server)
        ray.kill(router)


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    error: str | None = None
    instance: str = ""  # where it ended


async def stream(fleet: Fleet, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None,
                 after: int | None = None, during: Callable[[str, str], Awaitable] | None = None,
                 tokens: int = TOKENS) -> Streamed:
    """One completion through the frontend; once `after` tokens have arrived, `during(request_id, instance)` runs
    (the stream keeps buffering meanwhile)."""
    prep = fleet.frontend.prepare(prompt, max_tokens=tokens, temperature=temperature, top_p=1.0, top_k=0, seed=seed,
                                  stop=(), n=1, priority=0, ignore_eos=True)
    call = await fleet.frontend.start(prep)
    out = Streamed()
    async for _, item in call:
        out.tokens += item.delta.token_ids
        out.text += item.delta.text
        if item.delta.finished:
            out.finish, out.error = item.delta.finish_reason, item.delta.error
        if during is not None and after is not None and len(out.tokens) >= after:
            await during(prep.request_id, call.routed[0][0])
            during = None
    out.instance = call.routed[0][0]
    await asyncio.sleep(0.05)  # the release calls the frontend sent when the stream ended
    return out


def wait_no_pending(fleet: Fleet, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.get(fleet.router.pending.remote()):
        assert time.monotonic() < deadline, ray.get(fleet.router.requests.remote("running"))
        time.sleep(0.1)


def kv_free(fleet: Fleet) -> None:
    for name, server in fleet.servers.items():
        assert ray.get(server.kv_blocks_used.remote(), timeout=30) == (0, 0), name


def other(fleet: Fleet, instance: str) -> str:
    return next(n for n in fleet.servers if n != instance)


@contextlib.asynccontextmanager
async def held(fleet: Fleet, *instances: str) -> AsyncIterator[None]:
    """The instances take no step inside (InstanceServer.pause; what is posted to them still applies, a migration's
    calls included), then step again: an event placed inside lands between two steps, and a stream held there
    cannot end before it, however long the event takes (rather than a stream made long enough to outlast it)."""
    await asyncio.gather(*(fleet.servers[i].pause.remote(HOLD_S) for i in instances))
    try:
        yield
    finally:
        await asyncio.gather(*(fleet.servers[i].resume.remote() for i in instances))


class Begun:
    """Counts the streams whose first tokens arrived (each stream's `during`); `enough` is set at `want` of them."""

    def __init__(self, want: int) -> None:
        self.count, self.want = 0, want
        self.enough = asyncio.Event()

    async def during(self, _rid: str, _instance: str) -> None:
        self.count += 1
        if self.count >= self.want:
            self.enough.set()


def row(fleet: Fleet, rid: str) -> RequestRow:
    return next(r for r in ray.get(fleet.router.requests.remote()) if r.request_id == rid)


@pytest.mark.parametrize(("seed", "transfer"), [(None, "torch"), (11, "torch"), (None, "object_store")],
                         ids=["greedy", "seeded sampling", "greedy through the object store"])
def test_a_stream_follows_its_request_through_migrations(fleet, seed, transfer) -> None:
    prompt = text_prompts(load(fleet.cfg.model.target), 1, offset=6)[0]
    temperature = 0.0 if seed is None else 0.8
    alone = asyncio.run(stream(fleet, prompt, temperature=temperature, seed=seed))
    results = []

    async def migrate_twice(rid: str, instance: str) -> None:
        # held: the request decodes nowhere until it is back, so it still runs when the second migration starts
        async with held(fleet, *fleet.servers):
            for _ in range(2):  # there and back
                to = other(fleet, instance)
                results.append(await fleet.router.migrate.remote(rid, to, MigrationConfig(transfer=transfer)))
                instance = to

    moved = asyncio.run(stream(fleet, prompt, temperature=temperature, seed=seed, after=20, during=migrate_twice))

    assert [r.status.value for r in results] == ["finished", "finished"], results
    # what the destination's prefix cache held (the unmigrated run's blocks) is not copied
    assert all(r.stages >= 1 and r.tokens_copied + r.tokens_skipped > len(prompt) and r.transfer == transfer
               for r in results)
    assert moved.finish is FinishReason.LENGTH and len(moved.tokens) == TOKENS
    assert moved.tokens == alone.tokens and moved.text == alone.text  # no gap, no duplicate, same output
    stats = ray.get(fleet.router.migration_stats.remote())
    assert stats.by_status["finished"] >= 2 and stats.downtime_count >= 2 and stats.downtime_sum_s > 0
    kv_free(fleet)
    wait_no_pending(fleet)


# two target stages split after layer 1 (LAYOUTS["ray"] splits after layer 2), the draft on a third node
SPLIT_AFTER_1 = ShardLayout(stages=(StageSlot(node="a100", layers=(0, 1)), StageSlot(node="l4-0", layers=(1, 4))),
                            draft_node="l4-1")


def test_the_kv_goes_shard_to_shard_between_instances_split_differently(fleet) -> None:
    """Two instances of shard actors whose stages split the layers differently: the KV (target and draft) goes from
    each source shard to each destination shard that holds its layers, 3 + 1 links there and back; the stream
    gives the unmigrated output."""
    prompt = text_prompts(load(fleet.cfg.model.target), 1, offset=12)[0]
    alone = asyncio.run(stream(fleet, prompt))
    fleet.start("shards-a", executor="ray")
    fleet.start("shards-b", executor="ray", layout=SPLIT_AFTER_1)
    others = ("mig-a", "mig-b", "shards-b")
    for name in others:  # the request starts on shards-a
        ray.get(fleet.router.drain.remote(name))
    results = []

    async def there_and_back(rid: str, instance: str) -> None:
        assert instance == "shards-a"
        async with held(fleet, "shards-a", "shards-b"):
            await fleet.router.undrain.remote("shards-b")
            for to in ("shards-b", "shards-a"):
                results.append(await fleet.router.migrate.remote(rid, to, MigrationConfig(transfer="torch")))

    try:
        moved = asyncio.run(stream(fleet, prompt, after=20, during=there_and_back))
        assert [(r.status.value, r.transfer, r.links) for r in results] == [("finished", "torch", 4)] * 2, results
        assert all(r.draft_tokens > 0 for r in results), results
        assert moved.tokens == alone.tokens and moved.text == alone.text and moved.instance == "shards-a"
        kv_free(fleet)
    finally:  # the fleet as it was for the next tests: the two instances it started, both open
        for name in ("shards-a", "shards-b"):
            ray.get(fleet.router.deregister.remote(name))
            ray.get(fleet.servers[name].shutdown.remote(), timeout=60)
            ray.kill(fleet.servers.pop(name), no_restart=True)
        for name in ("mig-a", "mig-b"):
            ray.get(fleet.router.undrain.remote(name))


def test_migrations_between_the_same_two_instances_run_side_by_side(fleet) -> None:
    """Each migration opens its own KV channel: three at once from one instance to the other all land, each
    request with its own KV (a shared channel would cross their tensors or fail them)."""
    prompts = text_prompts(load(fleet.cfg.model.target), 3, offset=21)
    alone = [asyncio.run(stream(fleet, p)) for p in prompts]
    full, empty = "mig-a", "mig-b"
    ray.get(fleet.router.drain.remote(empty))  # every request starts on `full`

    async def run() -> tuple[list[Streamed], list]:
        begun = Begun(len(prompts))
        tasks = [asyncio.create_task(stream(fleet, p, after=1, during=begun.during)) for p in prompts]
        await begun.enough.wait()
        async with held(fleet, full):  # none can end at `full` while the three move side by side
            running = await fleet.router.requests.remote("running")
            assert {r.instance_id for r in running} == {full} and len(running) == len(prompts)
            await fleet.router.undrain.remote(empty)
            moves = await asyncio.gather(*(fleet.router.migrate.remote(r.request_id, empty,
                                                                       MigrationConfig(transfer="torch"))
                                           for r in running))
        return await asyncio.gather(*tasks), moves

    try:
        results, moves = asyncio.run(run())
    finally:
        ray.get(fleet.router.undrain.remote(empty))
    assert [(m.status.value, m.transfer) for m in moves] == [("finished", "torch")] * len(prompts), moves
    for got, want in zip(results, alone):
        assert got.instance == empty and got.tokens == want.tokens
    kv_free(fleet)
    wait_no_pending(fleet)


def test_a_migrating_drain_empties_the_instance(fleet) -> None:
    """Every request running on the drained instance completes elsewhere. The instances are held while it drains, so
    that none can end at the victim while the drain migrates the others one after another."""
    prompts = text_prompts(load(fleet.cfg.model.target), 3, offset=2)
    drained: list[DrainResult] = []

    async def run() -> list[Streamed]:
        begun = Begun(len(prompts))
        tasks = [asyncio.create_task(stream(fleet, p, after=1, during=begun.during)) for p in prompts]
        await begun.enough.wait()  # every stream has begun
        async with held(fleet, *fleet.servers):
            running = [r.instance_id for r in await fleet.router.requests.remote("running")]
            victim = max(fleet.servers, key=running.count)
            drained.append(await fleet.router.drain_migrate.remote(victim))
        return await asyncio.gather(*tasks)

    alone = [asyncio.run(stream(fleet, p)) for p in prompts]
    try:
        results = asyncio.run(run())
        [d] = drained
        assert d.migrated >= 1 and d.running == 0 and not d.not_moved, d
        for got, want in zip(results, alone):
            assert got.tokens == want.tokens and got.finish is FinishReason.LENGTH
            assert got.instance != d.instance_id
    finally:
        for d in drained:
            ray.get(fleet.router.undrain.remote(d.instance_id))
    kv_free(fleet)


FULL, EMPTY = "mig-a", "mig-b"


def under_policy(fleet: Fleet, prompts: list[list[int]], migration: MigrationConfig, tokens: int,
                 drain_full: bool = False, moves: int = 1, timeout_s: float = 90.0) -> tuple[list[Streamed], int]:
    """Every prompt starts on FULL (EMPTY drained); once those FULL runs have begun, FULL is held between two steps
    and the router plans with `migration` and EMPTY opens (and FULL drains, with `drain_full`); FULL steps again
    once `moves` migrations finished (or `timeout_s` passed), so that no request can end there before the policy
    moves it. The streams' results and the migrations that finished meanwhile; the router's config and every
    instance's dispatch are restored afterwards."""
    before = ray.get(fleet.router.migration_stats.remote()).by_status["finished"]
    ray.get(fleet.router.drain.remote(EMPTY))

    async def finished() -> int:
        return (await fleet.router.migration_stats.remote()).by_status["finished"] - before

    async def run() -> list[Streamed]:
        begun = Begun(min(len(prompts), fleet.cfg.scheduler.max_batch_size))  # those that run at once
        tasks = [asyncio.create_task(stream(fleet, p, tokens=tokens, after=1, during=begun.during)) for p in prompts]
        await begun.enough.wait()
        async with held(fleet, FULL):
            deadline = time.monotonic() + timeout_s
            while len(running := await fleet.router.requests.remote("running")) < len(prompts):  # all routed
                assert time.monotonic() < deadline, running
                await asyncio.sleep(0.05)
            assert {r.instance_id for r in running} == {FULL}
            await fleet.router.configure.remote(RouterConfig(stats_interval_s=0.2, migration=migration))
            await fleet.router.undrain.remote(EMPTY)
            if drain_full:
                await fleet.router.drain.remote(FULL)
            while await finished() < moves and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
    finally:
        ray.get(fleet.router.configure.remote(RouterConfig(stats_interval_s=0.2)))
        for name in fleet.servers:
            ray.get(fleet.router.undrain.remote(name))
    return results, ray.get(fleet.router.migration_stats.remote()).by_status["finished"] - before


@pytest.mark.parametrize("policy", ["balance", "drain"])
def test_the_router_migrates_on_its_own_by_policy(fleet, policy) -> None:
    """With `router.migration.policies` set, the router's planning loop moves requests: `balance` spreads four
    requests that all started on one instance; `drain` empties an instance of three as soon as it is drained."""
    # the policy moves one request per round, and each must still be running then: the source is held until it
    # moved one (`balance`) or all (`drain`)
    n, tokens = (4, TOKENS) if policy == "balance" else (3, TOKENS)
    prompts = text_prompts(load(fleet.cfg.model.target), n, offset=13)
    alone = [asyncio.run(stream(fleet, p)) for p in prompts]
    migration = MigrationConfig(policies=(policy,), interval_s=0.2,
                                thresholds=MigrationPolicyConfig(high_water=0.001, low_water=0.5))

    results, moved = under_policy(fleet, prompts, migration, tokens, drain_full=policy == "drain",
                                  moves=1 if policy == "balance" else n)

    ended_on = [r.instance for r in results]
    if policy == "balance":
        assert moved >= 1 and EMPTY in ended_on and FULL in ended_on, (moved, ended_on)
    else:
        assert moved == len(prompts) and set(ended_on) == {EMPTY}, (moved, ended_on)
    for got, want in zip(results, alone):  # greedy: the first TOKENS tokens are the unmigrated run's
        assert got.tokens[:TOKENS] == want.tokens and len(got.tokens) == tokens
        assert got.finish is FinishReason.LENGTH
    kv_free(fleet)
    wait_no_pending(fleet)


def test_the_queue_policy_starts_queued_requests_on_an_instance_that_opens(fleet) -> None:
    """A scale-out: ten requests land on one instance that runs eight at once; when a second instance opens, the
    `queue` policy moves the two that wait (no KV yet) there, where they start; every output is the target's."""
    prompts = text_prompts(load(fleet.cfg.model.target), 10, offset=3)

    async def batch() -> list[Streamed]:
        return await asyncio.gather(*(stream(fleet, p) for p in prompts))

    alone = asyncio.run(batch())

    results, moved = under_policy(fleet, prompts, MigrationConfig(policies=("queue",), interval_s=0.2), TOKENS)

    ended_on = [r.instance for r in results]
    assert moved >= 1 and ended_on.count(EMPTY) == moved, (moved, ended_on)
    for got, want in zip(results, alone):
        assert got.tokens == want.tokens and got.finish is FinishReason.LENGTH
    kv_free(fleet)
    wait_no_pending(fleet)


def test_killing_an_instance_under_load_loses_no_request(fleet) -> None:
    """Failover: the streams of a killed instance resume elsewhere from their tokens; output as if nothing happened."""
    prompts = text_prompts(load(fleet.cfg.model.target), 3, offset=9)
    alone = [asyncio.run(stream(fleet, p)) for p in prompts]
    fleet.start("mig-victim")
    for name in ("mig-a", "mig-b"):  # new requests go to the victim only
        ray.get(fleet.router.drain.remote(name))

    async def run() -> list[Streamed]:
        tasks = [asyncio.create_task(stream(fleet, p)) for p in prompts]
        await asyncio.sleep(0.3)
        for name in ("mig-a", "mig-b"):
            await fleet.router.undrain.remote(name)
        ray.kill(fleet.servers.pop("mig-victim"), no_restart=True)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())

    for got, want in zip(results, alone):
        assert got.error is None and got.finish is FinishReason.LENGTH
        assert got.tokens == want.tokens and got.text == want.text
        assert got.instance in ("mig-a", "mig-b")
    assert ray.get(fleet.router.migration_stats.remote()).failovers >= 1
    kv_free(fleet)


def test_killing_one_shard_of_an_instance_under_load_loses_no_request(fleet) -> None:
    """Failover from a shard: one stage actor of a two-stage instance dies; its streams resume elsewhere, unchanged."""
    prompts = text_prompts(load(fleet.cfg.model.target), 2, offset=17)
    alone = [asyncio.run(stream(fleet, p)) for p in prompts]
    fleet.start("mig-shards", executor="ray")
    for name in ("mig-a", "mig-b"):  # new requests go to the two-stage instance only
        ray.get(fleet.router.drain.remote(name))

    async def run() -> list[Streamed]:
        tasks = [asyncio.create_task(stream(fleet, p)) for p in prompts]
        await asyncio.sleep(0.5)
        assert {r.instance_id for r in await fleet.router.requests.remote("running")} == {"mig-shards"}
        for name in ("mig-a", "mig-b"):
            await fleet.router.undrain.remote(name)
        ray.kill(ray.get_actor("mig-shards/stage-1"), no_restart=True)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
    finally:
        ray.kill(fleet.servers.pop("mig-shards"), no_restart=True)
    for got, want in zip(results, alone):
        assert got.error is None and got.finish is FinishReason.LENGTH
        assert got.tokens == want.tokens and got.text == want.text
        assert got.instance in ("mig-a", "mig-b")
    kv_free(fleet)
