"""The router: a named Ray actor holding the instance registry, the request table and the dispatch policy.

Instances register when they start (and again if the router restarted: registration is idempotent). The
router polls each instance's stats and health every `stats_interval_s`; an instance that reports unhealthy
or does not answer within `health_timeout_s` is removed, and its requests in flight are marked failed (their
streams end with the instance's error). The API (deploy/serve/app.py) asks `route` where a request goes, then
streams from that instance directly; the router stays off the token path.

The router also moves running requests between instances (Llumnix's global scheduler): on demand
(`migrate`, `drain_migrate`), and when `router.migration.policies` are set, every `interval_s` and whenever an
instance joins or drains (`plan_migrations`). A request whose instance died resumes elsewhere (`failover`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import ray
from ray.actor import ActorHandle

from cluster.config import MigrationConfig, RouterConfig
from cluster.migration import MigrationResult, MigrationStatus, RayEndpoint, migrate
from cluster.migration_policy import InstanceLoad, make_planner
from cluster.dispatch import make_dispatch
from cluster.instances import InstancePlace, InstanceRow
from cluster.registry import NoInstanceAvailable, Registry, RequestStatus
from cluster.stats import MigrationStats

ROUTER_NAME = "specfleet-router"
NAMESPACE = "specfleet"
log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests are pending than the configured limit; retry after a while."""


class Router:
    def __init__(self, cfg: RouterConfig, health_timeout_s: float = 10.0) -> None:
        self.cfg = cfg
        self.registry = Registry(make_dispatch(cfg.dispatch))
        self.handles: dict[str, ActorHandle] = {}
        self.max_model_len: dict[str, int] = {}
        self.health_timeout_s = health_timeout_s
        self.removed: list[InstanceRow] = []  # instances taken out for failing health, newest last
        self._poller: asyncio.Task | None = None
        self._planner: asyncio.Task | None = None
        self._replan = asyncio.Event()  # an instance joined or is draining: plan migrations now
        self._migrating: dict[str, asyncio.Event] = {}  # requests migrating, each event set when its migration ends
        self.migration_figures = MigrationStats({s.value: 0 for s in MigrationStatus})

    async def configure(self, cfg: RouterConfig) -> None:
        """Take a redeployed app's router config (the actor outlives app redeploys; the registry stays)."""
        if cfg.dispatch != self.cfg.dispatch:
            self.registry.policy = make_dispatch(cfg.dispatch)
        self.cfg = cfg

    # ---- instances ----------------------------------------------------------------------------------
    async def register(self, instance_id: str, handle: ActorHandle, model: str, max_model_len: int, node: str,
                       place: InstancePlace = InstancePlace()) -> None:
        self.registry.register(instance_id, model, node, time.time(), place)
        self.handles[instance_id] = handle
        self.max_model_len[model] = max_model_len
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
            self._planner = asyncio.get_running_loop().create_task(self._plan_forever())
        self._replan.set()

    async def deregister(self, instance_id: str) -> bool:
        self.handles.pop(instance_id, None)
        return self.registry.remove(instance_id) is not None

    async def is_registered(self, instance_id: str) -> bool:
        return instance_id in self.registry.instances

    async def instances(self) -> list[InstanceRow]:
        return [e.row() for e in self.registry.instances.values()]

    async def removed_instances(self) -> list[InstanceRow]:
        return list(self.removed)

    async def models(self) -> dict[str, int]:
        """Served model name -> context length, over healthy instances."""
        return {m: self.max_model_len[m] for m in self.registry.models()}

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

    async def undrain(self, instance_id: str) -> None:
        try:
            self.registry.set_draining(instance_id, False)
        except KeyError:
            raise ValueError(f"no instance {instance_id!r}") from None
        self._replan.set()

    # ---- requests -----------------------------------------------------------------------------------
    async def route(self, request_id: str, priority: int = 0, model: str | None = None,
                    max_pending: int | None = None) -> tuple[str, ActorHandle]:
        """Choose the instance for a new request: (instance id, its handle). Raises Overloaded or NoInstanceAvailable."""
        if max_pending is not None and self.registry.pending() >= max_pending:
            raise Overloaded(f"{self.registry.pending()} requests are pending (limit {max_pending})")
        instance_id = self.registry.route(request_id, priority, time.time(), model)
        return instance_id, self.handles[instance_id]

    async def finish(self, request_id: str, status: str) -> None:
        self.registry.finish(request_id, RequestStatus(status), time.time())

    # ---- live migration and failover ----------------------------------------------------------------
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
        try:
            result = await migrate(request_id, RayEndpoint(self.handles[src]), RayEndpoint(self.handles[to]),
                                   cfg or self.cfg.migration, destination=(to, self.handles[to]), ids=(src, to))
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
            ended.set()
        log.info("migration of %s from %s to %s: %s %s", request_id, src, to, result.status.value, result.reason)
        return result

    async def drain_migrate(self, instance_id: str) -> dict:
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
        return {"instance_id": instance_id, "migrated": moved, "not_moved": stuck,
                "running": len(self.registry.instances[instance_id].in_flight)}

    async def failover(self, request_id: str, failed_instance: str) -> tuple[str, ActorHandle]:
        """A request's instance failed under it: the instance where it resumes (from its tokens), recorded as
        running there. Raises NoInstanceAvailable when no other instance is left."""
        migrating = self._migrating.get(request_id)
        if migrating is not None:  # let it end first: a copy it committed is cancelled before the stream resumes
            await migrating.wait()
        entry = self.registry.requests.get(request_id)
        model = self.registry.instances[failed_instance].model if failed_instance in self.registry.instances else None
        instance_id = self.registry.reroute(request_id, {failed_instance}, time.time(), model)
        self.migration_figures.failovers += 1
        log.warning("request %s resumes on %s after %s failed (was %s)", request_id, instance_id, failed_instance,
                    entry.status.value if entry else "?")
        return instance_id, self.handles[instance_id]

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
            loads.append(replace(load, draining=entry.draining, accepting=entry.accepting))
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
            except Exception:  # noqa: BLE001 - a failed round must not stop planning; the next one retries
                log.exception("planning migrations failed")

    async def expert_routing(self, instance_id: str) -> bytes:
        """An instance's online routing statistics since the last call (`specfleet experts profile --online`).
        ValueError for an unknown instance; LookupError if its target is not expert parallel."""
        if instance_id not in self.handles:
            raise ValueError(f"no instance {instance_id!r}")
        got = await self.handles[instance_id].expert_routing.remote()
        if got is None:
            raise LookupError(f"instance {instance_id!r} does not run its target expert parallel "
                              "(engine.experts.ranks is 1): it has no routing statistics")
        return got

    async def migration_stats(self) -> MigrationStats:
        """Migrations by outcome, their downtime, and failovers, since the router started."""
        return self.migration_figures

    async def abort(self, request_id: str) -> bool:
        """Cancel a running request at its instance; False if it is not running."""
        entry = self.registry.requests.get(request_id)
        if entry is None or entry.status != RequestStatus.RUNNING:
            return False
        handle = self.handles.get(entry.instance_id)
        if handle is None or not await handle.abort.remote(request_id):
            return False  # it ended at its instance just now; the API's `finish` records how
        self.registry.finish(request_id, RequestStatus.ABORTED, time.time())
        return True

    async def requests(self, status: str | None = None) -> list[dict]:
        rows = [r.as_dict() for r in self.registry.requests.values()]
        return [r for r in rows if status is None or r["status"] == status]

    async def pending(self) -> int:
        return self.registry.pending()

    # ---- polling ------------------------------------------------------------------------------------
    async def poll(self) -> None:
        """Refresh every instance's stats and health once; remove the ones that fail."""
        ids = list(self.handles)
        asked = {i: sorted(self.registry.instances[i].in_flight) if i in self.registry.instances else [] for i in ids}
        results = await asyncio.gather(*(self._probe(i, asked[i]) for i in ids), return_exceptions=True)
        for instance_id, result in zip(ids, results):
            if isinstance(result, BaseException):
                self._remove_failed(instance_id, f"{type(result).__name__}: {result}")
                continue
            stats, health, states = result
            now = time.time()
            self.registry.update(instance_id, stats, health.healthy, health.error, now)
            if not health.healthy:
                self._remove_failed(instance_id, health.error or "unhealthy")
                continue
            for r in self.registry.reconcile(instance_id, asked[instance_id], states, now, self.cfg.orphan_grace_s,
                                             moving=self._migrating):
                log.warning("request %s was still running at the router, but its instance %s %s; closed as %s",
                            r.request_id, r.instance_id, "ended it" if r.seen_by_instance else "never received it",
                            r.status.value)

    async def _probe(self, instance_id: str, asked: list[str]):
        handle = self.handles[instance_id]
        return await asyncio.wait_for(asyncio.gather(handle.stats.remote(), handle.health.remote(),
                                                     handle.request_states.remote(asked)), self.health_timeout_s)

    def _remove_failed(self, instance_id: str, error: str) -> None:
        if instance_id not in self.registry.instances:
            return
        for rid in self.registry.mark_unhealthy(instance_id, error):
            self.registry.finish(rid, RequestStatus.FAILED, time.time())
        entry = self.registry.remove(instance_id)
        self.handles.pop(instance_id, None)
        self.removed.append(entry.row(removed_at=time.time()))
        del self.removed[:-100]

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - a bad poll must not stop polling; the next one retries
                log.exception("polling the instances failed")
            await asyncio.sleep(self.cfg.stats_interval_s)


def get_or_create_router(cfg: RouterConfig) -> ActorHandle:
    """The cluster's router actor, started on first use (on the head node, with no CPU reserved)."""
    # detached: it outlives the replica that started it; the head-node resource keeps it beside the Serve proxy
    return ray.remote(Router).options(name=ROUTER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
                                      max_concurrency=1000, lifetime="detached",
                                      resources={"node:__internal_head__": 0.001}).remote(cfg)


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
