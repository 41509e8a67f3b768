"""An instance as a serving Ray actor: a thin wrapper over one Instance, requests streamed back as StreamItems.

The actor builds the Instance its InstanceSpec describes (placement/fleet.py): its stages in this process
(actors/local_stages.py) or in shard actors it starts on the planned nodes (actors/build.py); either way it
serves the same, through a ServingLoop (actors/serving.py).

    server = InstanceServer.spawn(spec)
    async for ref in server.generate.remote(request):   # a Ray streaming generator
        item: StreamItem = await ref

The actor is async: its event loop answers `stats`, `health` and `abort` while the loop thread steps, so
nothing waits behind a long step. A request the engine refuses comes back as one item with `rejected` set
(a typed message rather than an exception across the Ray boundary). If the caller stops consuming the
stream (it was cancelled), the request is aborted and its KV freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import ray
import torch
from ray.actor import ActorHandle

from actors.build import ray_instance
from actors.engine import RequestError
from actors.instance import Instance, InstanceUnhealthy
from actors.kv_cache import KVExport
from actors.ep_stages import EPStages
from actors.kv_links import LinkedKV, kv_span
from actors.pipeline import PipelineRunner
from actors.sequence import Sequence
from actors.build import local_instance
from actors.serving import ServingLoop, StreamItem
from cluster.request import FinishReason, Request, RequestStatus, TokenDelta
from cluster.migration import Link
from cluster.migration_policy import InstanceLoad
from cluster.stats import EngineStats
from placement.fleet import InstanceSpec
from placement.layout import PIN_UNITS

log = logging.getLogger(__name__)


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
    num_stages: int  # target pipeline stages


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    error: str | None


def build(spec: InstanceSpec) -> Instance:
    """The Instance `spec` describes, its stages where `spec.executor` says."""
    if spec.executor == "local":
        return local_instance(spec.engine, [s.layers for s in spec.layout.stages])
    return ray_instance(spec.engine, spec.layout, num_cpus=spec.num_cpus, step_timeout_s=spec.step_timeout_s,
                        name=spec.instance_id)


class InstanceServer:
    """One Instance serving streams."""

    def __init__(self, spec: InstanceSpec) -> None:
        torch.set_num_threads(max(1, math.ceil(spec.num_cpus)))
        self.spec = spec
        self.instance = build(spec)
        self.loop = ServingLoop(self.instance, name=f"engine-loop-{spec.instance_id}")
        self._detached: dict[str, Sequence] = {}  # migrating out: stopped here, KV kept until the commit
        self._handed_in: dict[str, asyncio.Queue[StreamItem]] = {}  # migrated in: items until the client follows
        self._links: dict[str, dict[str, list[Link]]] = {}  # each migration's open links: channel -> pipeline -> links

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

    async def resume_stream(self, request_id: str):
        """The stream of a request that migrated here (cluster/migration.py), from its first token here on: what the
        client's stream follows after the source's `migrated_to` item."""
        items = self._handed_in.get(request_id)
        if items is None:
            raise KeyError(f"no request {request_id!r} migrated to this instance")
        finished = False
        try:
            while True:
                item = await items.get()
                finished = item.delta.finished or item.migrated_to is not None
                yield item
                if finished:
                    return
        finally:
            self._handed_in.pop(request_id, None)
            if not finished:
                self.loop.abort(request_id)

    # ---- live migration: the Endpoint of cluster/migration.py; each step runs on the loop thread, between steps.
    # With `via` (a migration's channel) the KV goes over that migration's links, from the source's stages to the
    # destination's (actors/kv_links.py): the coordinator, and this process, carry only its headers.
    async def migrate_length(self, request_id: str) -> int | None:
        engine = self.instance.engine
        return await self._on_loop(lambda: engine.kv_length(request_id) if engine.holds(request_id) else None)

    async def migrate_reserve(self, request_id: str, tokens: int) -> bool:
        return await self._on_loop(lambda: self.instance.engine.reserve_incoming(request_id, tokens))

    async def migrate_export(self, request_id: str, start: int, end: int, via: str | None = None
                             ) -> tuple[list[KVExport] | LinkedKV, int] | None:
        links = self._route(via, "target")
        return await self._on_loop(lambda: self.instance.engine.export_out(request_id, start, end, links))

    async def migrate_import(self, kv: list[KVExport] | LinkedKV) -> bool:
        await self._receive(self.instance.target, kv)
        return await self._on_loop(lambda: self.instance.engine.import_kv(kv))

    async def migrate_export_draft(self, request_id: str, start: int, end: int, via: str | None = None
                                   ) -> tuple[list[KVExport] | LinkedKV, int] | None:
        links = self._route(via, "draft")
        got = await self._on_loop(lambda: self.instance.engine.export_draft(request_id, start, end, links))
        return None if got is None else (got, kv_span(got)[2])

    async def migrate_import_draft(self, kv: list[KVExport] | LinkedKV) -> bool:
        if self.instance.draft is None or not self.instance.draft.exports_kv:
            return False  # a draft whose KV cannot move takes none (no links were opened for it)
        await self._receive(self.instance.draft, kv)
        return await self._on_loop(lambda: self.instance.engine.import_draft(kv))

    async def migrate_stop(self, request_id: str, start: int, via: str | None = None
                           ) -> tuple[Request, list[KVExport] | LinkedKV, int, float] | None:
        asked = time.perf_counter()
        links = self._route(via, "target")

        def stop():
            waited = time.perf_counter() - asked  # the step under way went on: the request still decoded
            stopped = self.instance.engine.stop_out(request_id, start, links)
            if stopped is None:
                return None
            seq, resume, exported, end = stopped
            self._detached[request_id] = seq
            return dataclasses.replace(seq.request, resume=resume), exported, end, waited
        return await self._on_loop(stop)

    # ---- a migration's links (actors/kv_links.py): opened for one migration, closed after it
    def _pipeline(self, pipeline: str) -> PipelineRunner | None:
        return self.instance.target if pipeline == "target" else self.instance.draft

    def _route(self, via: str | None, pipeline: str) -> list[Link] | None:
        """The links of migration `via` that carry `pipeline`'s KV; None: it goes through the object store."""
        return None if via is None else self._links.get(via, {}).get(pipeline)

    async def _receive(self, runner: PipelineRunner, kv: list[KVExport] | LinkedKV) -> None:
        """KV that went over links: its stages receive it now, off the step loop (the import then takes it)."""
        if isinstance(kv, LinkedKV):
            await asyncio.to_thread(runner.executor.receive_links, kv)

    async def kv_stages(self, pipeline: str) -> list[tuple[int, ...]] | None:
        """The layers of each stage of `pipeline`; None without it, or if its stages cannot take links."""
        runner = self._pipeline(pipeline)
        if runner is None or not runner.executor.kv_links:
            return None
        return list(runner.executor.layer_ids)

    async def kv_device(self, pipeline: str = "target") -> str:
        """The device type the stages of `pipeline` keep their KV on ("cuda" or "cpu"): it picks its links' backend."""
        return await asyncio.to_thread(self._pipeline(pipeline).executor.kv_device)

    async def link_addresses(self, pipeline: str, stages: list[int]) -> list[str]:
        executor = self._pipeline(pipeline).executor
        return await asyncio.to_thread(executor.link_addresses, stages, ray.util.get_node_ip_address())

    async def links_open(self, channel: str, pipeline: str, links: list[Link], side: str, timeout_s: float = 30.0,
                         backend: str = "gloo") -> None:
        """Join the links of `pipeline` whose `side` end a stage of this instance is (both ends call this at once)."""
        self._links.setdefault(channel, {})[pipeline] = links
        await asyncio.to_thread(self._pipeline(pipeline).executor.open_links, links, side, timeout_s, backend)

    async def channel_close(self, channel: str) -> None:
        """Forget a migration's links. After a migration that finished, every send has been received; after one that
        failed, a send still under way ends with its link's timeout (and is logged), without being waited for."""
        for pipeline in self._links.pop(channel, {}):
            await asyncio.to_thread(self._pipeline(pipeline).executor.close_links, channel + "/")

    async def migrate_commit(self, request: Request) -> bool:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamItem] = asyncio.Queue()  # held until the client's stream comes (resume_stream)
        self._handed_in[request.request_id] = items
        try:
            await asyncio.wrap_future(
                self.loop.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
        except BaseException:
            self._handed_in.pop(request.request_id, None)
            raise
        return True

    async def migrate_release(self, request_id: str, committed: bool, destination: tuple[str, object] | None) -> None:
        def release() -> None:
            seq = self._detached.pop(request_id, None)
            if seq is None:
                return
            if committed:
                self.instance.engine.release_detached(seq)
            else:
                self.instance.engine.reattach(seq)
        await self._on_loop(release)
        if committed:
            await asyncio.wrap_future(self.loop.hand_over(request_id, destination))

    async def migrate_drop(self, request_id: str) -> None:
        await self._on_loop(lambda: self.instance.engine.drop_incoming(request_id))

    async def migrate_cancel(self, request_id: str) -> None:
        if self._handed_in.pop(request_id, None) is not None:  # no client will follow it here
            await self.abort(request_id)

    async def _on_loop(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    async def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with finish_reason "abort". False if it was not in flight."""
        return await asyncio.wrap_future(self.loop.abort(request_id))

    async def request_states(self, request_ids: list[str]) -> dict[str, RequestStatus]:
        """For the router's reconciliation: RUNNING for the ids this instance holds, the final status of those
        that ended here; ids it never took are left out (actors/serving.py, ServingLoop.states)."""
        return self.loop.states(request_ids)

    async def stats(self) -> EngineStats:
        return self.instance.stats()

    async def load(self) -> InstanceLoad:
        """Per-request KV blocks and queued demand, read between two steps (the router's migration policies)."""
        return await self._on_loop(lambda: self.instance.engine.load(self.spec.instance_id))

    async def expert_routing(self) -> bytes | None:
        """The routing statistics of the tokens its expert-parallel ranks ran since the last call, as a statistics
        file's bytes (actors/moe/profile.py); None if the target is not expert parallel."""
        executor = getattr(self.instance.target, "executor", None)
        if not isinstance(executor, EPStages):
            return None
        stats = await self._on_loop(executor.routing)  # between two steps: the ranks answer in order
        return stats.to_bytes(model=self.spec.engine.model.target)

    async def health(self) -> HealthReport:
        shards = self.instance.health()
        if not shards.healthy:
            return HealthReport(False, shards.error)
        if self.loop.alive:
            return HealthReport(True, None)
        return HealthReport(False, f"engine loop stopped: {self.loop.error!r}")

    async def info(self) -> InstanceInfo:
        engine = self.instance.engine
        return InstanceInfo(self.spec.instance_id, self.spec.engine.model.served_name, engine.max_model_len,
                            ray.get_runtime_context().get_node_id(), engine.draft is not None, engine.k,
                            engine.policy.name, self.instance.health().num_stages)

    async def kv_blocks_used(self) -> tuple[int, int]:
        """(target, draft) KV blocks in use; both are 0 once every request has ended."""
        return self.instance.kv_blocks_used()

    def shutdown(self) -> None:
        self.loop.close()
        self.instance.shutdown()

    @staticmethod
    def pin(spec: InstanceSpec) -> dict[str, float]:
        """The custom resource that puts the actor on the node of the instance's first stage."""
        return {spec.layout.pin(spec.layout.stages[0].node): PIN_UNITS}

    @classmethod
    def spawn(cls, spec: InstanceSpec, *, resources: dict[str, float] | None = None,
              name: str | None = None) -> ActorHandle:
        """Start the actor (it loads its models, or starts its shards, at once) with `resources` (default: the
        pin to its first stage's node). A local instance reserves the spec's CPUs; one over shard actors only
        drives them."""
        local = spec.executor == "local"  # then the actor's process computes, on the plan's GPU if it has one
        lay = spec.layout
        gpus = lay.stages[0].gpus + (lay.draft_gpus if lay.draft_node is not None else 0.0) if local else 0.0
        actor_cls = ray.remote(cls).options(num_cpus=spec.num_cpus if local else 0.0, num_gpus=gpus,
                                            resources=cls.pin(spec) if resources is None else resources,
                                            max_restarts=0, max_concurrency=1000, name=name)
        return actor_cls.remote(spec)
