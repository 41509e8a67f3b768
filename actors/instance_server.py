"""An instance as a serving Ray actor: a ServingLoop over an engine, requests streamed back as StreamItems.

The engine is either in this process (stages=1) or drives pipeline stage actors and a draft actor that this
actor starts on the nodes the planner picks (stages>1: actors/build.py, actors/instance.py); both serve the same.

    server = InstanceServer.spawn(engine_cfg, "inst-0", num_cpus=1)
    async for ref in server.generate.remote(request):   # a Ray streaming generator
        item: StreamItem = await ref

The actor is async: its event loop answers `stats`, `health` and `abort` while the loop thread steps, so
nothing waits behind a long step. A request the engine refuses comes back as one item with `rejected` set
(a typed message rather than an exception across the Ray boundary). If the caller stops consuming the
stream (it was cancelled), the request is aborted and its KV freed.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import ray
import torch
from ray.actor import ActorHandle

from actors.build import build_shards, resolved
from actors.engine import Engine, RequestError
from actors.instance import Instance, InstanceUnhealthy
from actors.model.loader import load_config
from actors.serving import ServingLoop, StreamItem
from cluster.config import EngineConfig
from cluster.request import FinishReason, Request, TokenDelta
from cluster.stats import EngineStats
from placement.inventory import inventory_from_labels
from placement.layout import ShardLayout
from placement.model_size import model_size_from_config
from placement.planner import plan


@dataclass(frozen=True)
class InstanceInfo:
    """What the router and the API need to know about an instance once, at registration."""

    instance_id: str
    model: str  # the served model name clients use
    max_model_len: int
    node_id: str
    has_draft: bool
    k: int
    policy: str
    num_stages: int  # target pipeline stages (1: a single process)


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    error: str | None


class InstanceServer:
    """One single-process instance (actors/engine.py) serving streams."""

    def __init__(self, cfg: EngineConfig, instance_id: str, threads: int = 1, stages: int = 1,
                 shard_cpus: float = 1.0) -> None:
        from deploy.model_store import resolve_model  # catalog names are fetched on first use, on this node

        torch.set_num_threads(threads)
        self.instance_id = instance_id
        self.served_name = cfg.model.served_name
        self.instance: Instance | None = None  # the pipeline-split instance, when stages > 1
        if stages == 1:
            self.engine = Engine.from_config(cfg, resolve=resolve_model)
            self.loop = ServingLoop(self.engine, name=f"engine-loop-{instance_id}")
            return
        cfg = resolved(cfg, resolve_model)
        self.shards = build_shards(cfg, planned_layout(cfg, stages), num_cpus=shard_cpus, name=instance_id)
        self.instance = Instance(cfg, self.shards.target, self.shards.draft, step_timeout_s=120.0)
        self.engine = self.instance.engine
        self.loop = ServingLoop(self.engine, step=self.instance.step, add=self.instance.add_request,
                                name=f"engine-loop-{instance_id}")

    async def generate(self, request: Request):
        """Stream the request's StreamItems until its final one (finish, abort or error)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamItem] = asyncio.Queue()
        finished = False
        try:
            try:
                await asyncio.wrap_future(
                    self.loop.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
            except (RequestError, InstanceUnhealthy, RuntimeError) as e:
                finished = True
                yield StreamItem(TokenDelta(request.request_id, (), "", FinishReason.ERROR, error=str(e)),
                                 rejected=isinstance(e, RequestError))
                return
            while True:
                item = await items.get()
                finished = item.delta.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation): free its KV
                self.loop.abort(request.request_id)

    async def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with finish_reason "abort". False if it was not in flight."""
        return await asyncio.wrap_future(self.loop.abort(request_id))

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def health(self) -> HealthReport:
        shards = self.instance.health() if self.instance is not None else None
        if shards is not None and not shards.healthy:
            return HealthReport(False, shards.error)
        if self.loop.alive:
            return HealthReport(True, None)
        return HealthReport(False, f"engine loop stopped: {self.loop.error!r}")

    async def info(self) -> InstanceInfo:
        return InstanceInfo(self.instance_id, self.served_name, self.engine.max_model_len,
                            ray.get_runtime_context().get_node_id(), self.engine.draft is not None,
                            self.engine.k, self.engine.policy.name,
                            len(self.instance.target.executor.layer_ids) if self.instance is not None else 1)

    async def kv_blocks_used(self) -> tuple[int, int]:
        """(target, draft) KV blocks in use; both are 0 once every request has ended."""
        draft = self.engine.draft.cache.num_used_blocks if self.engine.draft is not None else 0
        return self.engine.target.cache.num_used_blocks, draft

    def shutdown(self) -> None:
        self.loop.close()
        if self.instance is not None:
            self.shards.kill()

    @classmethod
    def spawn(cls, cfg: EngineConfig, instance_id: str, *, num_cpus: float = 1.0, stages: int = 1,
              resources: dict[str, float] | None = None, name: str | None = None) -> ActorHandle:
        """Start the actor (it loads its models, or starts its shards, at once); `resources` pins it, e.g. to an
        accelerator kind. With `stages` > 1 the engine actor only drives the shards, each of `num_cpus` CPUs."""
        engine_cpus = num_cpus if stages == 1 else 0.0
        actor_cls = ray.remote(cls).options(num_cpus=engine_cpus, resources=resources or {}, max_restarts=0,
                                            max_concurrency=1000, name=name)
        return actor_cls.remote(cfg, instance_id, threads=max(1, math.ceil(num_cpus)), stages=stages,
                                shard_cpus=num_cpus)


def planned_layout(cfg: EngineConfig, stages: int) -> ShardLayout:
    """The planner's layout of one instance in `stages` stages over the running cluster's labelled nodes."""
    m = cfg.model
    inventory = inventory_from_labels([n["Labels"] for n in ray.nodes() if n["Alive"]])
    dtype_bytes = 2 if m.dtype == "bf16" else 4
    target = model_size_from_config(load_config(m.target), dtype_bytes=dtype_bytes)
    draft = model_size_from_config(load_config(m.draft), dtype_bytes=dtype_bytes) if m.draft else None
    p = plan(inventory, target, draft, kv_tokens=cfg.cache.num_blocks * cfg.cache.block_size, num_stages=stages)
    layout = ShardLayout.from_plan(p.instances[0])
    if m.draft_layers is not None and layout.draft_node is None:  # a self-draft shares the target's weights
        layout = layout.model_copy(update={"draft_node": layout.stages[0].node})
    return layout
