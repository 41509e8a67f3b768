"""An instance as a serving Ray actor: a thin wrapper over one Instance, requests streamed back as StreamItems.

The actor builds the Instance its InstanceSpec describes (placement/fleet.py): its stages in this process
(actors/executors/local.py) or in shard actors it starts on the planned nodes (actors/serving/build.py); either way it
serves the same, through a ServingLoop (actors/serving/loop.py).

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
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import ray
import torch
from ray.actor import ActorHandle

import actors

from actors.serving.build import local_instance, ray_instance
from actors.model.device import describe_compute
from actors.engine.core import RequestError
from actors.serving.instance import Instance, InstanceUnhealthy
from actors.executors.protocol import KVLinks
from actors.serving.grammar_pool import GrammarPool
from actors.kv.links import LinkedKV, MigratedKV, kv_span
from actors.serving.leases import Leases
from actors.transport.p2p import use_node_interface
from actors.executors.pipeline import PipelineRunner
from actors.engine.sequence import EngineSequence
from actors.serving.loop import ServingLoop
from actors.speculation.structured import CompiledGrammar
from actors.start_phases import StartClock, StartPhases
from cluster.coalesce import Coalescer
from cluster.disagg import Role
from cluster.instances import InstancePlace
from cluster.request import FinishReason, Request, RequestStatus, StreamItem, TokenDelta
from cluster.migration_messages import (BlockNames, CloseChannel, Commit, Drop, Export, Exported, Import, KVLayout,
                                        Length, Link, LinkAddresses, MigrationMessage, Names, OpenLinks, Pipeline,
                                        Release, Reservation, Reserve, StagesKV, Stop, Stopped)
from cluster.router import INSTANCE_ACTOR_PREFIX
from cluster.migration_policy import InstanceLoad
from cluster.prefix_index import CacheEvents
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
    actor_id: str = ""  # this incarnation: a replacement registers under the same instance id with another
    # the path its target model runs on and why (actors/model/backends.py BackendPlan.describe), then how it computes
    # (actors/model/device.py describe_compute: dtype, device, our CPU kernels' ISA and why)
    backend: str = ""


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    error: str | None


# seconds an instance actor sleeps as it builds: a slow start injected on purpose by the fault kit (deploy/bench/
# fault_kit.py, through its replicas' environment, which their instance actors inherit), so the failover tests hold
# the learned wait (cluster/start_times.py) to starts slower than its floor
START_DELAY_ENV = "SPECFLEET_FAULT_START_DELAY_S"


@dataclass(frozen=True)
class Registration:
    """What a (re)started router learns from an instance: what it is, where it runs, and the requests it holds
    (queued, running, stopped for a migration or committed here by one), each with its priority."""

    info: InstanceInfo
    place: InstancePlace
    requests: tuple[tuple[str, int], ...]
    start_s: float | None = None  # how long building this instance took (its models, kernels, calibration)
    phases: StartPhases | None = None  # where that time went (actors/start_phases.py)
    role: Role = "both"  # its disaggregation role, as its spec gives it (cluster/disagg.py)


def build(spec: InstanceSpec) -> Instance:
    """The Instance `spec` describes, its stages where `spec.executor` says. Shard actors are named after the
    instance actor's own name when it has one (unique per incarnation: a replacement's shards never collide with
    those of the instance it replaces), else after the instance id."""
    calibration = Path(spec.calibration_dir) if spec.calibration_dir else None
    if spec.executor == "local":
        return local_instance(spec.engine, [s.layers for s in spec.layout.stages], calibration_dir=calibration)
    own = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    name = own.removeprefix(INSTANCE_ACTOR_PREFIX) if own else spec.instance_id
    return ray_instance(spec.engine, spec.layout, num_cpus=spec.num_cpus, step_timeout_s=spec.step_timeout_s,
                        name=name, calibration_dir=calibration)


class InstanceServer:
    """One Instance serving streams."""

    def __init__(self, spec: InstanceSpec, spawned_at: float | None = None) -> None:
        """`spawned_at`: when its spawner asked for this actor (time.time()), for the start's process phase."""
        began = time.monotonic()
        torch.set_num_threads(max(1, math.ceil(spec.num_cpus)))
        if ray.is_initialized():  # its stages' KV links to other nodes: over the node's own address
            use_node_interface(ray.util.get_node_ip_address())
        self.spec = spec
        delay = float(os.environ.get(START_DELAY_ENV) or 0)
        with StartClock().current() as clock:  # what the loading code below marks (actors/start_phases.py)
            if delay > 0:
                log.warning("%s: start slowed by %.1f s on purpose (%s)", spec.instance_id, delay, START_DELAY_ENV)
                with clock.phase("injected delay"):
                    time.sleep(delay)
            self.instance = build(spec)
        self.phases = _with_process(clock.result(), began, spawned_at)
        self.start_s = time.monotonic() - began  # a restarted router's failover wait learns from it (registration)
        log.info("%s started in %.1f s: %s", spec.instance_id, self.start_s,
                 ", ".join(f"{n} {s:.1f} s" for n, s in self.phases.phases))
        self.loop = ServingLoop(self.instance, name=f"engine-loop-{spec.instance_id}", idle=self.instance.idle_work)
        # structured outputs' grammars, compiled on a pool of their own (never on the loop thread that steps)
        self.grammars = GrammarPool(self.instance.engine.grammars, spec.engine.grammar)
        self._detached: dict[str, EngineSequence] = {}  # migrating out: stopped here, KV kept until the commit
        self._handed_in: dict[str, asyncio.Queue[StreamItem]] = {}  # migrated in: items until the client follows
        self._links: dict[str, dict[str, list[Link]]] = {}  # each migration's open links: channel -> pipeline -> links
        # what a migration leaves here, let go of by the instance itself if its coordinator does not come back:
        # ("incoming", id) a reservation, ("stopped", id) a request stopped here, ("follow", id) a copy committed
        # here that waits for its client's stream (actors/serving/leases.py)
        self._leases = Leases()

    async def generate(self, request: Request):
        """Stream the request's StreamItems until its final one (finish, abort or error)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamItem] = asyncio.Queue()
        finished = False
        try:
            try:
                grammar = await self._grammar(request)
                await asyncio.wrap_future(
                    self.loop.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item), grammar))
            except (RequestError, InstanceUnhealthy, RuntimeError) as e:
                finished = True
                # an instance that is unhealthy, or whose loop stopped, fails as a dead one would: the API replica
                # resumes the request elsewhere; only the engine's refusal (RequestError) is the request's own
                refused = isinstance(e, RequestError)
                yield StreamItem(TokenDelta(request.request_id, (), "", FinishReason.ERROR, error=str(e),
                                            instance_failure=not refused), rejected=refused)
                return
            out = Coalescer(items, self.spec.engine.scheduler.stream_interval)  # what waits goes out as one item
            while True:
                item = await out.next()
                finished = item.delta.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation): free its KV
                self.loop.abort(request.request_id)

    async def _grammar(self, request: Request) -> CompiledGrammar | None:
        """The request's structured output compiled off the loop (actors/serving/grammar_pool.py); None without one."""
        spec = request.params.structured
        return None if spec is None else await self.grammars.compile(request.tenant, spec)

    async def resume_stream(self, request_id: str):
        """The stream of a request that migrated here (cluster/migration.py), from its first token here on: what the
        client's stream follows after the source's `migrated_to` item."""
        items = self._handed_in.get(request_id)
        if items is None:
            raise KeyError(f"no request {request_id!r} migrated to this instance")
        self._leases.end(("follow", request_id))
        finished = False
        try:
            out = Coalescer(items, self.spec.engine.scheduler.stream_interval)
            while True:
                item = await out.next()
                finished = item.delta.finished or item.migrated_to is not None
                yield item
                if finished:
                    return
        finally:
            self._handed_in.pop(request_id, None)
            if not finished:
                self.loop.abort(request_id)

    # ---- live migration: the Endpoint of cluster/migration.py; each message is carried out on the loop thread,
    # between steps. With `via` (a migration's channel) the KV goes over that migration's links, from the source's
    # stages to the destination's (actors/kv/links.py): the coordinator, and this process, carry only its headers.
    async def migration(self, msg: MigrationMessage) -> object:
        """Carry out one message of a migration (cluster/migration_messages.py says what each returns)."""
        match msg:
            case Length(rid):
                return await self._on_loop(lambda: self.instance.kv_length(rid))
            case Names(rid):
                return await self._on_loop(lambda: self.instance.block_names(rid))
            case Reserve(rid, tokens, lease_s, names):
                return await self._reserve(rid, tokens, lease_s, names)
            case Export(rid, pipeline, start, end, via):
                links = self._route(via, pipeline)
                got = await self._on_loop(lambda: self.instance.export(pipeline, rid, start, end, links))
                return None if got is None else Exported(*got)
            case Import(pipeline, kv):
                return await self._import(pipeline, kv)
            case Stop(rid, start, via, lease_s):
                return await self._stop(rid, start, via, lease_s)
            case Commit(request):
                return await self._commit(request)
            case Release(rid, committed, destination):
                return await self._release(rid, committed, destination)
            case Drop(rid):
                return await self._drop(rid)
            case KVLayout(pipeline):
                return await self._kv_layout(pipeline)
            case LinkAddresses(pipeline, stages):
                executor = self._pipeline(pipeline).executor
                return await asyncio.to_thread(executor.link_addresses, list(stages), ray.util.get_node_ip_address())
            case OpenLinks(channel, pipeline, links, side, timeout_s, backend):
                self._links.setdefault(channel, {})[pipeline] = list(links)
                await asyncio.to_thread(self._pipeline(pipeline).executor.open_links, list(links), side, timeout_s,
                                        backend)
                return None
            case CloseChannel(channel):
                # after a migration that finished every send has been received; after one that failed, a send still
                # under way ends with its link's timeout (and is logged), without being waited for
                for pipeline in self._links.pop(channel, {}):
                    await asyncio.to_thread(self._pipeline(pipeline).executor.close_links, channel + "/")
                return None
        raise TypeError(f"not a migration message: {msg!r} (cluster/migration_messages.py lists them)")

    async def _reserve(self, request_id: str, tokens: int, lease_s: float, names: BlockNames) -> Reservation | None:
        reserved = await self._on_loop(lambda: self.instance.reserve_incoming(request_id, tokens, names))
        if reserved:  # each import renews it; the commit ends it (and a "follow" lease of the same length begins)
            self._leases.grant(("incoming", request_id), lease_s, lambda: self._drop(request_id))
        return reserved

    async def _import(self, pipeline: Pipeline, kv: MigratedKV) -> bool:
        runner = self._pipeline(pipeline)
        if pipeline is Pipeline.DRAFT and (runner is None or not runner.exports_kv):
            return False  # a draft whose KV cannot move takes none (no links were opened for it)
        self._renew_incoming(kv)
        await self._receive(runner, kv)
        return await self._on_loop(lambda: self.instance.import_kv(pipeline, kv))

    async def _stop(self, request_id: str, start: int, via: str | None, lease_s: float) -> Stopped | None:
        asked = time.perf_counter()
        links = self._route(via, Pipeline.TARGET)

        def stop():
            waited = time.perf_counter() - asked  # the step under way went on: the request still decoded
            stopped = self.instance.stop_out(request_id, start, links)
            if stopped is None:
                return None
            seq, resume, exported, end = stopped
            self._detached[request_id] = seq
            return Stopped(dataclasses.replace(seq.request, resume=resume), exported, end, waited)
        got = await self._on_loop(stop)
        if got is not None:  # no release within the lease: the coordinator is gone, the request carries on here
            self._leases.grant(("stopped", request_id), lease_s, lambda: self._release(request_id, False, None))
        return got

    # ---- a migration's links (actors/kv/links.py): opened for one migration, closed after it
    def _pipeline(self, pipeline: Pipeline) -> PipelineRunner | None:
        return self.instance.target if pipeline is Pipeline.TARGET else self.instance.draft

    def _route(self, via: str | None, pipeline: Pipeline) -> list[Link] | None:
        """The links of migration `via` that carry `pipeline`'s KV; None: it goes through the object store."""
        return None if via is None else self._links.get(via, {}).get(pipeline)

    async def _receive(self, runner: PipelineRunner, kv: MigratedKV) -> None:
        """KV that went over links: its stages receive it now, off the step loop (the import then takes it)."""
        if isinstance(kv, LinkedKV):
            await asyncio.to_thread(runner.executor.receive_links, kv)

    async def _kv_layout(self, pipeline: Pipeline) -> StagesKV | None:
        """The layers of each stage of `pipeline` and the device type they keep their KV on (it picks the links'
        backend); None without it, or if its stages cannot take links."""
        runner = self._pipeline(pipeline)
        if runner is None or not isinstance(runner.executor, KVLinks):
            return None
        return StagesKV(list(runner.executor.layer_ids), await asyncio.to_thread(runner.executor.kv_device))

    async def _commit(self, request: Request) -> bool:
        rid = request.request_id
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamItem] = asyncio.Queue()  # held until the client's stream comes (resume_stream)
        self._handed_in[rid] = items
        try:
            grammar = await self._grammar(request)
            await asyncio.wrap_future(
                self.loop.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item), grammar))
        except BaseException:
            self._handed_in.pop(rid, None)
            raise
        lease_s = self._leases.seconds(("incoming", rid)) or 60.0
        self._leases.end(("incoming", rid))
        if rid in self._handed_in:  # no stream follows within the lease: the copy runs for nobody
            self._leases.grant(("follow", rid), lease_s, lambda: self._cancel(rid))
        return True

    async def _release(self, request_id: str, committed: bool, destination: tuple[str, object] | None) -> bool:
        """See cluster/migration_messages.py, Release: False when the request is no longer held here stopped (its
        client left while it moved, or its lease ran out and it resumed here)."""
        self._leases.end(("stopped", request_id))

        def release() -> bool:
            seq = self._detached.pop(request_id, None)
            if seq is None:
                return False
            if not self.loop.tracks(request_id):  # its client left meanwhile: nothing to resume or hand over
                self.instance.release_detached(seq)
                return False
            if committed:
                self.instance.release_detached(seq)
            else:
                self.instance.reattach(seq)
            return True
        released = await self._on_loop(release)
        if released and committed:
            return await asyncio.wrap_future(self.loop.hand_over(request_id, destination))
        return released

    async def _drop(self, request_id: str) -> None:
        """Forget a request that was not committed here (free what was reserved and imported for it), or a copy that
        was committed (its commit timed out at the coordinator, then landed; or its source failed before its
        release, or its client left): it is cancelled."""
        self._leases.end(("incoming", request_id))
        await self._on_loop(lambda: self.instance.drop_incoming(request_id))
        await self._cancel(request_id)

    async def _cancel(self, request_id: str) -> None:
        self._leases.end(("follow", request_id))
        if self._handed_in.pop(request_id, None) is not None:  # no client will follow it here
            await self.abort(request_id)

    def _renew_incoming(self, kv: MigratedKV) -> None:
        if kv:
            self._leases.renew(("incoming", kv_span(kv)[0]))

    async def _on_loop(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    async def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with finish_reason "abort". False if it was not in flight."""
        return await asyncio.wrap_future(self.loop.abort(request_id))

    async def request_states(self, request_ids: list[str]) -> dict[str, RequestStatus]:
        """For the router's reconciliation: RUNNING for the ids this instance holds, the final status of those
        that ended here; ids it never took are left out (actors/serving/loop.py, ServingLoop.states)."""
        return self.loop.states(request_ids)

    async def stats(self) -> EngineStats:
        """Read between two steps, like everything of the engine (the loop thread owns it)."""
        return await self._on_loop(self.instance.stats)

    async def cache_events(self, snapshot: bool = False) -> CacheEvents:
        """The router's prefix index feed (cluster/prefix_index.py): the next numbered batch of blocks cached and
        evicted, or a snapshot of all it holds; read between two steps, with the stats."""
        return await self._on_loop(lambda: self.instance.cache_events(snapshot))

    async def load(self) -> InstanceLoad:
        """Per-request KV blocks and queued demand, read between two steps (the router's migration policies)."""
        return await self._on_loop(lambda: self.instance.load(self.spec.instance_id))

    async def expert_routing(self) -> bytes | None:
        """The routing statistics of the tokens its expert-parallel ranks ran since the last call, as a statistics
        file's bytes (actors/moe/profile.py); None if the target is not expert parallel."""
        stats = await self._on_loop(self.instance.expert_routing)  # between two steps: the ranks answer in order
        return None if stats is None else stats.to_bytes(model=self.spec.engine.model.target)

    async def health(self) -> HealthReport:
        """Whether the instance serves: its shards and its step loop (read between two steps; a loop that stopped
        answers at once). It asks nobody else: the router being down never makes an instance unhealthy."""
        try:
            shards = await self._on_loop(self.instance.health)
        except RuntimeError:  # the loop stopped: it posts nothing more
            return HealthReport(False, f"engine loop stopped: {self.loop.error!r}")
        if not shards.healthy:
            return HealthReport(False, shards.error)
        return HealthReport(True, None)

    async def info(self) -> InstanceInfo:
        def read() -> InstanceInfo:
            inst, health = self.instance, self.instance.health()
            target = inst.engine.target
            return InstanceInfo(self.spec.instance_id, self.spec.engine.model.served_name, inst.max_model_len,
                                _runtime_id("node"), health.has_draft, inst.k, inst.policy, health.num_stages,
                                _runtime_id("actor"), f"{target.model.plan.describe()}; "
                                f"{describe_compute(target.model.dtype, target.device)}")
        return await self._on_loop(read)

    async def registration(self) -> Registration:
        """What a router that (re)starts rebuilds its registry and request table from."""
        def held() -> tuple[tuple[str, int], ...]:
            priority = {s.request_id: s.request.priority for s in self.instance.waiting + self.instance.running}
            priority.update({rid: seq.request.priority for rid, seq in self._detached.items()})
            return tuple((rid, priority.get(rid, 0)) for rid in self.loop.tracked_ids())
        return Registration(await self.info(), self.spec.place, await self._on_loop(held), self.start_s,
                            self.phases, self.spec.role)

    async def start_phases(self) -> StartPhases:
        """Where this instance's start went, phase by phase (`specfleet bench start`, `specfleet status`)."""
        return self.phases

    async def pause(self, seconds: float) -> None:
        """Take no step for at most `seconds` (or until `resume`): returns once the loop is between two steps.
        Streams stay open and keep their place; migrations, aborts and reads go on (actors/serving/loop.py, Pause)."""
        await asyncio.wrap_future(self.loop.pause(seconds))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.loop.resume())

    async def pid(self) -> int:
        """This actor's process id (operators, fault tests that kill it)."""
        return os.getpid()

    async def kv_blocks_used(self) -> tuple[int, int]:
        """(target, draft) KV blocks in use; both are 0 once every request has ended."""
        return await self._on_loop(self.instance.kv_blocks_used)

    def shutdown(self) -> None:
        self.loop.close()
        self.grammars.shutdown()
        self.instance.shutdown()

    @staticmethod
    def pin(spec: InstanceSpec) -> dict[str, float]:
        """The custom resource that puts the actor on the node of the instance's first stage."""
        return {spec.layout.pin(spec.layout.stages[0].node): PIN_UNITS}

    @classmethod
    def spawn(cls, spec: InstanceSpec, *, resources: dict[str, float] | None = None,
              name: str | None = None, namespace: str | None = None,
              lifetime: Literal["detached"] | None = None) -> ActorHandle:
        """Start the actor (it loads its models, or starts its shards, at once) with `resources` (default: the
        pin to its first stage's node). A local instance reserves the spec's CPUs; one over shard actors only
        drives them. `lifetime` "detached": it outlives the process that spawned it (Ray's actor lifetimes)."""
        local = spec.executor == "local"  # then the actor's process computes, on the plan's GPU if it has one
        lay = spec.layout
        gpus = lay.stages[0].gpus + (lay.draft_gpus if lay.draft_node is not None else 0.0) if local else 0.0
        actor_cls = ray.remote(cls).options(num_cpus=spec.num_cpus if local else 0.0, num_gpus=gpus,
                                            resources=cls.pin(spec) if resources is None else resources,
                                            max_restarts=0, max_concurrency=1000, name=name, namespace=namespace,
                                            lifetime=lifetime)
        return actor_cls.remote(spec, time.time())


def _with_process(phases: StartPhases, began: float, spawned_at: float | None) -> StartPhases:
    """The start's phases with what came before its constructor: the process (the actor scheduled, its worker
    started) and the data plane's imports, when its spawner said when it asked (`spawned_at`, a wall clock)."""
    if spawned_at is None:
        return phases
    imports_from = max(actors.IMPORT_BEGAN, spawned_at)  # a worker that imported earlier (a reused one) paid none
    before = time.time() - (time.monotonic() - began)  # the constructor's start, on the wall clock
    phases = phases.with_phase("imports", max(0.0, before - imports_from), first=True)
    return phases.with_phase("process", max(0.0, imports_from - spawned_at), first=True)


def _runtime_id(what: str) -> str:
    """This process's node id or actor id (its incarnation), or "" outside a Ray worker."""
    if not ray.is_initialized():  # an in-process instance (tests)
        return ""
    context = ray.get_runtime_context()
    return (context.get_node_id() if what == "node" else context.get_actor_id()) or ""
