"""Cache-aware routing on the real local cluster: instances report the blocks they cache with the router's poll, and a
request whose prompt starts like one an instance served goes there under `cache_aware`, and by load alone under
`least_load`; a request with another `cache_salt` finds nothing; a router started afresh learns the same from the
instances' snapshots.

Every poll here is the test's own (`stats_interval_s` is long): the index changes only when the test says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray

from actors.serving.server import InstanceServer
from cluster.config import (CacheConfig, EngineConfig, ModelConfig, RouterConfig, SchedulerConfig, SpecfleetConfig,
                            SpeculationConfig)
from cluster.request import Request, SamplingParams
from cluster.router import Router
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from placement.fleet import InstanceSpec
from tests.ray.test_instance_server import CPUS, LAYOUTS
from tests.unit.helpers import load, reference_greedy, text_prompts

IDS = ("p0", "p1", "p2")  # least load breaks ties by id: an idle fleet sends a request to p0
TOKENS = 8


@dataclass
class Cluster:
    servers: dict[str, ray.actor.ActorHandle]
    engine: EngineConfig
    router: ray.actor.ActorHandle | None = None
    frontend: Frontend | None = None

    def start_router(self, dispatch: str) -> None:
        cfg = RouterConfig(dispatch=dispatch, stats_interval_s=3600.0)
        self.router = ray.remote(Router).options(max_concurrency=100, num_cpus=0).remote(cfg)
        for instance_id, server in self.servers.items():
            info = ray.get(server.info.remote(), timeout=60)
            ray.get(self.router.register.remote(instance_id, server, info.model, info.max_model_len, info.node_id))
        self.frontend = Frontend(frontend_config(SpecfleetConfig(engine=self.engine, router=cfg)), self.router)
        self.poll()

    def poll(self) -> None:
        ray.get(self.router.poll.remote(), timeout=60)

    def hits(self) -> dict[str, int]:
        return {i: ray.get(s.stats.remote(), timeout=60).prefix_cache.hits for i, s in self.servers.items()}


@pytest.fixture(scope="module")
def cluster(ray_driver, tiny_models) -> Iterator[Cluster]:
    engine = EngineConfig(model=ModelConfig(target=str(tiny_models["llama"])), speculation=SpeculationConfig(
        policy="off"), scheduler=SchedulerConfig(max_batch_size=4),
        cache=CacheConfig(block_size=4, num_blocks=128, prefix_caching=True))
    servers = {i: InstanceServer.spawn(InstanceSpec(instance_id=i, layout=LAYOUTS["local"], executor="local",
                                                    num_cpus=CPUS, engine=engine)) for i in IDS}
    c = Cluster(servers, engine)
    try:
        yield c
    finally:
        if c.router is not None:
            ray.kill(c.router)
        for server in servers.values():
            ray.kill(server)


async def complete(frontend: Frontend, prompt: list[int], cache_salt: str | None = None) -> tuple[str, list[int]]:
    """One greedy completion through the frontend: where it ran, and its tokens."""
    prep = frontend.prepare(prompt, max_tokens=TOKENS, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(), n=1,
                            priority=0, ignore_eos=True, cache_salt=cache_salt)
    call = await frontend.start(prep)
    tokens = [t for choice in await call.collect() for t in choice.token_ids]
    return call.routed[0][0], tokens


async def direct(server, rid: str, prompt: list[int]) -> list[int]:
    """A request sent to an instance itself, never routed: only its cache events can tell the router about it."""
    tokens = []
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    async for ref in server.generate.options(num_returns="streaming").remote(Request(rid, tuple(prompt), params)):
        tokens += (await ref).delta.token_ids
    return tokens


def test_a_shared_prefix_goes_where_it_is_cached_under_cache_aware_and_by_load_under_least_load(cluster,
                                                                                                 tiny_models) -> None:
    path = tiny_models["llama"]
    shared, a, b, c = text_prompts(load(path), 4, offset=0)  # 40 tokens (10 blocks) shared, then their own
    first, second, third = shared + a[:5], shared + b[:6], shared + c[:7]
    holder = IDS[-1]  # never the least loaded one's choice in an idle fleet

    assert asyncio.run(direct(cluster.servers[holder], "seed", first)) == reference_greedy(path, first, TOKENS)
    cluster.start_router("cache_aware")  # its first poll: every instance's snapshot
    stats = ray.get(cluster.router.routing_stats.remote())
    assert stats.policy == "cache_aware" and stats.index_instances == 3 and stats.index_entries >= 10
    before = cluster.hits()

    where, tokens = asyncio.run(complete(cluster.frontend, second))
    assert where == holder and tokens == reference_greedy(path, second, TOKENS)
    after = cluster.hits()
    assert after[holder] - before[holder] == 40  # the whole shared prefix came from the cache

    where, tokens = asyncio.run(complete(cluster.frontend, third, cache_salt="tenant-b"))  # its own cache: no holder
    assert where == IDS[0] and tokens == reference_greedy(path, third, TOKENS)
    assert cluster.hits()[IDS[0]] == after[IDS[0]]
    assert ray.get(cluster.router.routing_stats.remote()).decisions == {"prefix": 1, "load": 1}

    ray.get(cluster.router.configure.remote(RouterConfig(dispatch="least_load", stats_interval_s=3600.0)))
    cluster.poll()  # the salted request's blocks at p0 are known now: least load ignores them and every prefix
    where, tokens = asyncio.run(complete(cluster.frontend, third))
    assert where == IDS[0] != holder and tokens == reference_greedy(path, third, TOKENS)
    assert ray.get(cluster.router.routing_stats.remote()).decisions["load"] == 2
    ray.kill(cluster.router)

    cluster.start_router("cache_aware")  # a router started afresh asks every instance for a snapshot
    where, tokens = asyncio.run(complete(cluster.frontend, shared + a[:3]))
    assert where in (holder, IDS[0]) and tokens == reference_greedy(path, shared + a[:3], TOKENS)
    assert ray.get(cluster.router.routing_stats.remote()).decisions == {"prefix": 1}
