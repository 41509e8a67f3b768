"""An instance as a serving Ray actor: a ServingLoop over an engine, requests streamed back as StreamItems.

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

from actors.engine import Engine, RequestError
from actors.serving import ServingLoop, StreamItem
from cluster.config import EngineConfig
from cluster.request import FinishReason, Request, TokenDelta
from cluster.stats import EngineStats


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


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    error: str | None


class InstanceServer:
    """One single-process instance (actors/engine.py) serving streams."""

    def __init__(self, cfg: EngineConfig, instance_id: str, threads: int = 1) -> None:
        from deploy.model_store import resolve_model  # catalog names are fetched on first use, on this node

        torch.set_num_threads(threads)
        self.instance_id = instance_id
        self.engine = Engine.from_config(cfg, resolve=resolve_model)
        self.served_name = cfg.model.served_name
        self.loop = ServingLoop(self.engine, name=f"engine-loop-{instance_id}")

    async def generate(self, request: Request):
        """Stream the request's StreamItems until its final one (finish, abort or error)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamItem] = asyncio.Queue()
        finished = False
        try:
            try:
                await asyncio.wrap_future(
                    self.loop.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
            except (RequestError, RuntimeError) as e:
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
        if self.loop.alive:
            return HealthReport(True, None)
        return HealthReport(False, f"engine loop stopped: {self.loop.error!r}")

    async def info(self) -> InstanceInfo:
        return InstanceInfo(self.instance_id, self.served_name, self.engine.max_model_len,
                            ray.get_runtime_context().get_node_id(), self.engine.draft is not None,
                            self.engine.k, self.engine.policy.name)

    async def kv_blocks_used(self) -> tuple[int, int]:
        """(target, draft) KV blocks in use; both are 0 once every request has ended."""
        draft = self.engine.draft.cache.num_used_blocks if self.engine.draft is not None else 0
        return self.engine.target.cache.num_used_blocks, draft

    def shutdown(self) -> None:
        self.loop.close()

    @classmethod
    def spawn(cls, cfg: EngineConfig, instance_id: str, *, num_cpus: float = 1.0,
              resources: dict[str, float] | None = None, name: str | None = None) -> ActorHandle:
        """Start the actor (it loads its models at once); `resources` pins it, e.g. to an accelerator kind."""
        actor_cls = ray.remote(cls).options(num_cpus=num_cpus, resources=resources or {}, max_restarts=0,
                                            max_concurrency=1000, name=name)
        return actor_cls.remote(cfg, instance_id, threads=max(1, math.ceil(num_cpus)))
