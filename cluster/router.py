"""The router: a named Ray actor holding the instance registry, the request table and the dispatch policy.

Instances register when they start (and again if the router restarted: registration is idempotent). The
router polls each instance's stats and health every `stats_interval_s`; an instance that reports unhealthy
or does not answer within `health_timeout_s` is removed, and its requests in flight are marked failed (their
streams fail over). The API (deploy/serve/app.py) asks `route` where a request goes, then streams from that
instance directly; the router stays off the token path.

The router holds soft state only. The cluster's router (`get_or_create_router`) restarts when its process dies,
and whoever finds it gone for good (killed) starts another by its name; either way it rebuilds its registry and
request table from the instances it finds by name (`InstanceServer.registration`: what each runs and queues)
before it answers anything. Streams keep flowing meanwhile (instance -> API replica); API replicas and instances
reach the new router through cluster/router_client.py.

The router also moves running requests between instances (Llumnix's global scheduler): on demand
(`migrate`, `drain_migrate`), and when `router.migration.policies` are set, every `interval_s` and whenever an
instance joins or drains (`plan_migrations`). A request whose instance died resumes elsewhere (`failover`).

Instances may register with a role (`prefill`, `decode`, `both`): then a new request is placed on a pair and moved to
its decode instance after its first token (cluster/disagg.py, cluster/handoff.py, docs/disaggregation.md).

The actor is the thin part: the polling is cluster/health.py's, disaggregation cluster/handoff.py's, migration
cluster/migration.py's, placement cluster/registry.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace

import ray
from ray.actor import ActorHandle

from cluster.config import MigrationConfig, RouterConfig
from cluster.migration import MigrationProgress, MigrationResult, MigrationStatus, RayEndpoint, migrate
from cluster.migration_policy import InstanceLoad, make_planner
from cluster.disagg import PromptShape, Role
from cluster.dispatch import make_dispatch
from cluster.handoff import Disaggregation
from cluster.health import InstancePoller
from cluster.instances import DrainResult, InstancePlace, InstanceRow, RequestRow
from cluster.registry import NoInstanceAvailable, Registry, RequestStatus
from cluster.prefix_index import PrefixIndex
from cluster.start_times import Arrivals, FailoverWait, StartHistory
from cluster.stats import FailedRounds, MigrationStats, RoutingStats

ROUTER_NAME = "specfleet-router"
NAMESPACE = "specfleet"
INSTANCE_ACTOR_PREFIX = "specfleet-instance/"  # + instance id + "/" + incarnation: instances the router finds
log = logging.getLogger(__name__)


def _after_start(method):
    """The method runs once the router has rebuilt its state (a fresh router answers nothing before that)."""
    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        if self._started is not None:
            await asyncio.shield(self._started)
        return await method(self, *args, **kwargs)
    return wrapper


class Overloaded(RuntimeError):
    """More requests are pending than the configured limit; retry after a while."""


class Router:
    def __init__(self, cfg: RouterConfig, health_timeout_s: float = 10.0, discover: bool = False) -> None:
        self.cfg = cfg
        ca = cfg.cache_aware
        self.registry = Registry(_dispatch(cfg), prefix=PrefixIndex(max_entries=ca.max_entries,
                                                                   provisional_s=ca.provisional_s))
        self.handles: dict[str, ActorHandle] = {}
        self.max_model_len: dict[str, int] = {}
        self.health_timeout_s = health_timeout_s
        self._poller: asyncio.Task | None = None
        self._planner: asyncio.Task | None = None
        self._replan = asyncio.Event()  # an instance joined or is draining: plan migrations now
        self._migrating: dict[str, asyncio.Event] = {}  # requests migrating, each event set when its migration ends
        self._progress: dict[str, tuple[str, str, MigrationProgress | None]] = {}  # (source, destination, progress)
        self.migration_figures = MigrationStats({s.value: 0 for s in MigrationStatus})
        fo = cfg.failover  # how long a failover waits for an instance to register: learned from the starts seen
        self.starts = StartHistory(fo.wait_s, fo.max_wait_s, fo.start_multiple)
        self.arrivals = Arrivals(self.starts, self.registry)  # a request that finds no instance waits for one
        self.failed_rounds = FailedRounds()  # the background loops' rounds that raised (routing_stats, /metrics)
        self.health = InstancePoller(cfg, self.registry, self.handles, self.starts, health_timeout_s, self._migrating,
                                     self.failed_rounds)
        self.disagg = Disaggregation(cfg.disaggregation, self.registry, self._load_of, self.migrate,
                                     lost_after_s=cfg.orphan_grace_s, failed=self.failed_rounds)
        # as a Ray actor this runs on its event loop: rebuild from the instances, then start polling and planning
        self._started: asyncio.Task | None = asyncio.get_running_loop().create_task(self._start(discover))

    async def _start(self, discover: bool) -> None:
        if discover:
            try:
                await self._rebuild()
            except Exception:  # noqa: BLE001 - the instances register again on their own (app.py); start anyway
                log.exception("rebuilding the registry from the instances failed")
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self.health.run_forever())
        self._planner = loop.create_task(self._plan_forever())
        self._handing_off = loop.create_task(self.disagg.handoffs.run_forever())

    async def _rebuild(self) -> None:
        """Register every instance actor found by name, with the requests each holds (a restarted router)."""
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        names = [a["name"] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith(INSTANCE_ACTOR_PREFIX)]
        handles = await asyncio.gather(*(asyncio.to_thread(ray.get_actor, n, namespace=NAMESPACE) for n in names),
                                       return_exceptions=True)
        live = [h for h in handles if not isinstance(h, BaseException)]
        got = await asyncio.gather(*(asyncio.wait_for(h.registration.remote(), self.health_timeout_s) for h in live),
                                   return_exceptions=True)
        now = time.time()
        for handle, reg in zip(live, got):
            if isinstance(reg, BaseException):
                log.warning("an instance actor did not report to the new router (%s: %s)", type(reg).__name__, reg)
                continue
            i = reg.info
            phases = reg.phases.phases if reg.phases is not None else ()
            self.starts.registered(i.instance_id, i.actor_id, time.monotonic(), reg.start_s, phases)  # its wait
            self.disagg.set_role(i.instance_id, reg.role)  # as it was given at its start (the autoscaler's too)
            self._register(i.instance_id, handle, i.model, i.max_model_len, i.node_id, reg.place, i.actor_id,
                           i.backend)
            for rid, priority in reg.requests:
                self.registry.adopt(rid, i.instance_id, priority, now)
        log.warning("router started: rebuilt %d instances and %d requests from the instances",
                    len(self.registry.instances), self.registry.pending())

    @_after_start
    async def configure(self, cfg: RouterConfig) -> None:
        """Take a redeployed app's router config (the actor outlives app redeploys; the registry stays)."""
        if (cfg.dispatch, cfg.cache_aware) != (self.cfg.dispatch, self.cfg.cache_aware):
            self.registry.policy = _dispatch(cfg)
        self.registry.prefix.provisional_s = cfg.cache_aware.provisional_s
        self.registry.prefix.max_entries = cfg.cache_aware.max_entries
        self.disagg.configure(cfg.disaggregation)
        self.cfg = self.health.cfg = cfg

    # ---- instances ----------------------------------------------------------------------------------
    @_after_start
    async def register(self, instance_id: str, handle: ActorHandle, model: str, max_model_len: int, node: str,
                       place: InstancePlace = InstancePlace(), incarnation: str = "", start_s: float | None = None,
                       backend: str = "", phases: tuple[tuple[str, float], ...] = (), role: Role = "both") -> None:
        """Add an instance, or its replacement (another `incarnation` under the same id); idempotent. `start_s`: how
        long this incarnation took to start (its replica's construction to now), which the failover wait learns;
        `backend`: the path its target model runs on and how it computes, and `phases`: where its start's time went
        (actors/start_phases.py), both as operators see them in `specfleet status`; `role`: prefill, decode or both
        (cluster/disagg.py)."""
        self.disagg.set_role(instance_id, role)
        self.starts.registered(instance_id, incarnation, time.monotonic(), start_s, phases)
        self._register(instance_id, handle, model, max_model_len, node, place, incarnation, backend)

    def _register(self, instance_id: str, handle: ActorHandle, model: str, max_model_len: int, node: str,
                  place: InstancePlace, incarnation: str, backend: str = "") -> None:
        self.registry.register(instance_id, model, node, time.time(), place, incarnation, backend)
        self.handles[instance_id] = handle
        self.max_model_len[model] = max_model_len
        self._replan.set()
        self.arrivals.joined()

    @_after_start
    async def deregister(self, instance_id: str, incarnation: str | None = None) -> bool:
        """Take an instance out; with `incarnation`, only that one (not a replacement that registered since)."""
        entry = self.registry.instances.get(instance_id)
        if entry is None or incarnation is not None and entry.incarnation != incarnation:
            return False
        self.handles.pop(instance_id, None)
        return self.registry.remove(instance_id, time.time()) is not None

    @_after_start
    async def is_registered(self, instance_id: str, incarnation: str | None = None, role: Role | None = None) -> bool:
        """Whether the router knows this instance (this incarnation, with this role, where given)."""
        entry = self.registry.instances.get(instance_id)
        return (entry is not None and (incarnation is None or entry.incarnation == incarnation)
                and (role is None or self.disagg.role(instance_id) == role))

    @_after_start
    async def instances(self) -> list[InstanceRow]:
        return [e.row().model_copy(update={"role": self.disagg.role(e.instance_id)})
                for e in self.registry.instances.values()]

    @_after_start
    async def removed_instances(self) -> list[InstanceRow]:
        return list(self.health.removed)

    @_after_start
    async def models(self) -> dict[str, int]:
        """Served model name -> context length, over healthy instances."""
        return {m: self.max_model_len[m] for m in self.registry.models()}

    @_after_start
    async def drain(self, instance_id: str, abort_running: bool = False) -> int:
        """Stop dispatching to an instance; optionally abort its requests in flight. Returns how many run there."""
        try:
            entry = self.registry.set_draining(instance_id)
        except KeyError:
            raise ValueError(f"no instance {instance_id!r}") from None
        running = sorted(entry.in_flight)
        self._replan.set()
        if abort_running:
            await asyncio.gather(*(self.abort(rid) for rid in running))
        return len(running)

    @_after_start
    async def undrain(self, instance_id: str) -> None:
        try:
            self.registry.set_draining(instance_id, False)
        except KeyError:
            raise ValueError(f"no instance {instance_id!r}") from None
        self._replan.set()

    # ---- requests -----------------------------------------------------------------------------------
    @_after_start
    async def route(self, request_id: str, priority: int = 0, model: str | None = None,
                    max_pending: int | None = None, blocks: tuple[int, ...] = (),
                    prompt: PromptShape | None = None) -> tuple[str, ActorHandle]:
        """Choose the instance for a new request: (instance id, its handle). Raises Overloaded or NoInstanceAvailable.
        `blocks` names the full KV blocks of its prompt (cluster/prefix.py, computed where it was tokenized): a
        cache-aware policy sends it where they are cached. Idempotent: a request already running (a caller's retry)
        gets where it runs. `prompt`: its length and block size; with instances of a prefill or decode role it
        places the request on a pair (cluster/disagg.py) and hands it off after its first token."""
        entry = self.registry.requests.get(request_id)
        if entry is not None and entry.status == RequestStatus.RUNNING and entry.instance_id in self.handles:
            return entry.instance_id, self.handles[entry.instance_id]
        if max_pending is not None and self.registry.pending() >= max_pending:
            raise Overloaded(f"{self.registry.pending()} requests are pending (limit {max_pending})")
        if self.disagg.split:
            instance_id = await self.arrivals.placed(
                lambda: self.disagg.route(request_id, priority, time.time(), model, blocks, prompt), model)
        else:
            instance_id = await self.arrivals.placed(
                lambda: self.registry.route(request_id, priority, time.time(), model, blocks), model)
        return instance_id, self.handles[instance_id]

    async def _load_of(self, instance_id: str):
        handle = self.handles.get(instance_id)
        if handle is None:
            raise LookupError(f"instance {instance_id!r} left")
        return await asyncio.wait_for(handle.load.remote(), self.health_timeout_s)

    @_after_start
    async def finish(self, request_id: str, status: RequestStatus) -> None:
        self.disagg.handoffs.drop(request_id)
        self.registry.finish(request_id, RequestStatus(status), time.time())

    # ---- live migration and failover ----------------------------------------------------------------
    @ray.method(max_task_retries=0)  # not idempotent: a restarted router does not redo it
    @_after_start
    async def migrate(self, request_id: str, to: str | None = None,
                      cfg: MigrationConfig | None = None) -> MigrationResult:
        """Move a running request to instance `to` (default: where dispatch would send a new request) with the
        staged coordinator (cluster/migration.py); its client's stream follows it."""
        entry = self.registry.requests.get(request_id)
        if entry is None or entry.status != RequestStatus.RUNNING:
            raise ValueError(f"no running request {request_id!r}")
        src = entry.instance_id
        if to is None:
            to = self.registry.choose(exclude={src}, model=self.registry.instances[src].model)
        if to == src or to not in self.handles or not self.registry.instances[to].accepting:
            raise NoInstanceAvailable(f"instance {to!r} cannot take request {request_id!r}: it is the request's "
                                      "own, unknown, draining or unhealthy")
        if request_id in self._migrating:
            raise NoInstanceAvailable(f"request {request_id!r} is already migrating")
        ended = self._migrating[request_id] = asyncio.Event()
        self._progress[request_id] = (src, to, None)
        try:
            result = await migrate(request_id, RayEndpoint(self.handles[src]), RayEndpoint(self.handles[to]),
                                   cfg or self.cfg.migration, destination=(to, self.handles[to]), ids=(src, to),
                                   progress=lambda p: self._progress.__setitem__(request_id, (src, to, p)))
            finished = result.status is MigrationStatus.FINISHED
            self.migration_figures.record(result.status.value, result.downtime_s if finished else None)
            if finished:
                still = self.registry.requests.get(request_id)
                if still is not None and still.status == RequestStatus.RUNNING:
                    self.registry.rehome(request_id, to)
                else:  # its client left while it moved: stop it where it now runs
                    await self.handles[to].abort.remote(request_id)
        finally:
            del self._migrating[request_id]
            self._progress.pop(request_id, None)
            ended.set()
        log.info("migration of %s from %s to %s: %s %s", request_id, src, to, result.status.value, result.reason)
        return result

    @ray.method(max_task_retries=0)  # not idempotent: a restarted router does not redo it
    @_after_start
    async def drain_migrate(self, instance_id: str) -> DrainResult:
        """Stop dispatching to an instance and migrate every request running there to the others; the instance
        ends empty (scale it down, or undrain it). Returns the counts and any request that could not move."""
        await self.drain(instance_id)
        moved, stuck = 0, []
        for rid in sorted(self.registry.instances[instance_id].in_flight):
            try:
                result = await self.migrate(rid)
            except (ValueError, NoInstanceAvailable) as e:
                stuck.append(f"{rid}: {e}")
                continue
            if result.status is MigrationStatus.FINISHED:
                moved += 1
            elif result.status is MigrationStatus.ABORTED_DST:
                stuck.append(f"{rid}: {result.reason}")
        return DrainResult(instance_id=instance_id, draining=True, migrated=moved, not_moved=stuck,
                           running=len(self.registry.instances[instance_id].in_flight))

    @_after_start
    async def failover(self, request_id: str, failed_instance: str, failed_handle: ActorHandle | None = None,
                       priority: int = 0, model: str | None = None,
                       blocks: tuple[int, ...] = ()) -> tuple[str, ActorHandle]:
        """A request's instance failed under it: the instance where it resumes (from its tokens: `blocks` names their
        full KV blocks, so a cache-aware policy prefers where they are cached), recorded as running there. With no other instance, it waits up to `failover.wait_s` for one to register (the
        replacement of the failed one counts: another incarnation under the same id). NoInstanceAvailable when
        the wait runs out."""
        self.disagg.handoffs.drop(request_id)  # it prefills again where it resumes, and stays there
        migrating = self._migrating.get(request_id)
        if migrating is not None:  # let it end first (every step has a deadline): a committed copy is cancelled
            await migrating.wait()
        failed = self.registry.instances.get(failed_instance)
        model = model or (failed.model if failed is not None else None)
        gone = failed.incarnation if failed is not None and failed_handle is None else None

        def reroute() -> str:
            # the failed incarnation is left out; a replacement that registered under its id is not
            entry = self.registry.instances.get(failed_instance)
            same = entry is not None and (self.handles.get(failed_instance) == failed_handle
                                          if failed_handle is not None else entry.incarnation == gone)
            exclude = self.disagg.resume_exclude(model, {failed_instance} if same else set())
            return self.registry.reroute(request_id, exclude, time.time(), model, priority, blocks)
        instance_id = await self.arrivals.placed(reroute, model)
        self.migration_figures.failovers += 1
        log.warning("request %s resumes on %s after %s failed", request_id, instance_id, failed_instance)
        return instance_id, self.handles[instance_id]

    @ray.method(max_task_retries=0)
    async def plan_migrations(self) -> list[MigrationResult]:
        """One round of the global scheduler: read every instance's load, ask the configured policies
        (cluster/migration_policy.py) which requests move where, and migrate them side by side."""
        cfg = self.cfg.migration
        if not cfg.policies or len(self.handles) < 2:
            return []
        loads = await self._loads()
        moves = make_planner(cfg.policies, cfg.thresholds).plan(loads, frozenset(self._migrating))
        results = await asyncio.gather(*(self.migrate(m.request_id, m.destination) for m in moves),
                                       return_exceptions=True)
        done = []
        for move, result in zip(moves, results):
            if isinstance(result, BaseException):  # it ended or its instance left since the loads were read
                log.info("planned migration %s (%s) not started: %s", move.request_id, move.reason, result)
            else:
                log.info("planned migration %s %s -> %s (%s): %s", move.request_id, move.source,
                         move.destination, move.reason, result.status.value)
                done.append(result)
        return done

    async def _loads(self) -> list[InstanceLoad]:
        ids = [i for i in self.handles if i in self.registry.instances]
        got = await asyncio.gather(*(asyncio.wait_for(self.handles[i].load.remote(), self.health_timeout_s)
                                     for i in ids), return_exceptions=True)
        loads = []
        for instance_id, load in zip(ids, got):
            entry = self.registry.instances.get(instance_id)
            if isinstance(load, BaseException) or entry is None:
                continue  # health polling deals with an instance that does not answer
            loads.append(replace(load, draining=entry.draining, accepting=entry.accepting,
                                 role=self.disagg.role(instance_id)))
        return loads

    async def _plan_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._replan.wait(), self.cfg.migration.interval_s)
            except asyncio.TimeoutError:
                pass
            self._replan.clear()
            try:
                await self.plan_migrations()
            except Exception as e:  # noqa: BLE001 - a failed round must not stop planning; the next one retries
                self.failed_rounds.record("migration_plan", e)  # counted: a defect failing every round shows
                log.exception("planning migrations failed")

    @ray.method(max_task_retries=0)  # not idempotent: a restarted router does not redo it
    @_after_start
    async def expert_routing(self, instance_id: str) -> bytes:
        """An instance's online routing statistics since the last call (`specfleet experts profile --online`).
        ValueError for an unknown instance; LookupError if its target is not expert parallel."""
        if instance_id not in self.handles:
            raise ValueError(f"no instance {instance_id!r}")
        got = await asyncio.wait_for(self.handles[instance_id].expert_routing.remote(), self.health_timeout_s)
        if got is None:
            raise LookupError(f"instance {instance_id!r} does not run its target expert parallel "
                              "(engine.experts.ranks is 1): it has no routing statistics")
        return got

    @_after_start
    async def migrations_in_flight(self) -> list[tuple[str, str, MigrationProgress | None]]:
        """Each migration under way: (source, destination, how far it got; None before the reservation)."""
        return list(self._progress.values())

    @_after_start
    async def routing_stats(self) -> RoutingStats:
        """The dispatch policy, its decisions by reason since the router started, the prefix index's size, the
        disaggregation figures, and the background loops' failed rounds."""
        index = self.registry.prefix
        failed = self.failed_rounds
        return RoutingStats(self.registry.policy.name, dict(self.registry.decisions), len(index),
                            sum(not index.wants_snapshot(i) for i in self.registry.instances),
                            dict(self.disagg.decisions), self.disagg.figures(), len(self.disagg.handoffs.pending),
                            dict(failed.counts), dict(failed.last_error))

    async def starting(self, instance_id: str) -> None:
        """A replica of `instance_id` begins to start (it registers when done): failovers wait for it."""
        self.starts.starting(instance_id, time.monotonic())

    @_after_start
    async def failover_wait(self) -> FailoverWait:
        """How long a request now waits for an instance to register, and the starts it was learned from."""
        return self.starts.wait()

    @_after_start
    async def migration_stats(self) -> MigrationStats:
        """Migrations by outcome, their downtime, and failovers, since the router started."""
        return self.migration_figures

    @_after_start
    async def abort(self, request_id: str) -> bool:
        """Cancel a running request at its instance; False if it is not running."""
        entry = self.registry.requests.get(request_id)
        if entry is None or entry.status != RequestStatus.RUNNING:
            return False
        handle = self.handles.get(entry.instance_id)
        if handle is None or not await asyncio.wait_for(handle.abort.remote(request_id), self.health_timeout_s):
            return False  # it ended at its instance just now; the API's `finish` records how
        self.registry.finish(request_id, RequestStatus.ABORTED, time.time())
        return True

    @_after_start
    async def requests(self, status: RequestStatus | None = None) -> list[RequestRow]:
        rows = [r.row() for r in self.registry.requests.values()]
        return [r for r in rows if status is None or r.status == RequestStatus(status)]

    @_after_start
    async def pending(self) -> int:
        return self.registry.pending()

    # ---- polling ------------------------------------------------------------------------------------
    async def poll(self) -> None:
        """Refresh every instance's stats, health and prefix-cache events once; remove the ones that fail."""
        await self.health.poll()


def _dispatch(cfg: RouterConfig):
    """The dispatch policy `cfg` names, with cache_aware's margins."""
    ca = cfg.cache_aware
    return make_dispatch(cfg.dispatch, ca.max_load_gap, ca.max_request_gap, ca.min_match)


def get_or_create_router(cfg: RouterConfig) -> ActorHandle:
    """The cluster's router actor, started on first use (on the head node, with no CPU reserved), or again by
    whoever finds it gone. It restarts when its process dies (`max_restarts=-1`); a call under way then is retried
    on the new one where the method is idempotent (all but those marked `max_task_retries=0`); either way it
    rebuilds its state from the instances it finds (`discover`)."""
    # detached: it outlives the replica that started it; the head-node resource keeps it beside the Serve proxy
    return ray.remote(Router).options(name=ROUTER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
                                      max_concurrency=1000, lifetime="detached", max_restarts=-1,
                                      max_task_retries=-1,
                                      resources={"node:__internal_head__": 0.001}).remote(cfg, discover=True)


def find_router(timeout_s: float = 60.0) -> ActorHandle:
    """The running router actor; waits for it to appear (a fresh app starts it with its first replica)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise NoInstanceAvailable(f"no router actor {ROUTER_NAME!r} in namespace {NAMESPACE!r}") from None
            time.sleep(0.2)
