"""The autoscaler at work: reads the router's load, asks the policy (cluster/autoscale.py), starts or drains instances.

Scale out: an instance is planned by the same planner as the deployed fleet, on the devices no instance holds
(deploy/serve/fleet.py `replan`), started as the deployed ones are (`InstanceServer.spawn`, named so that a
restarted router finds it), and registered with the router. Scale in never cuts a stream (Llumnix's scale-in, OSDI
'24): the leaving instance is drained through live migration (`Router.drain_migrate`: it takes no new request, its
running requests move live to the others and its queue is redistributed, each through the migration coordinator),
and only once the router counts nothing on it is it deregistered and stopped. A drain that cannot move everything
within `drain_timeout_s` is cancelled: the instance is put back in service, and the step is recorded as cancelled.

The deployed floor (`min_instances`, Serve's `SpecfleetInstance` deployments, replaced by Serve when they fail) is
never removed; the autoscaler removes only instances it started (ids `auto-<n>`). Those are detached actors, as Ray
Serve's controller starts its replicas: they outlive the autoscaler's replica, and a replica that replaces it adopts
them from the router's table (`adopt`), so that a failed autoscaler cuts no stream. `SpecfleetAutoscaler` runs it as
a one-replica Serve deployment beside the API, which reads its status for /metrics and `specfleet status`.

Its TTFT signal is measured by the API replicas: each pushes its record of recent first tokens and of requests still
waiting for one (cluster/first_token.py) every round, through the Serve handle it already holds to this deployment
(`report_ttft`, deploy/serve/ttft_reporter.py); a replica whose report is older than `REPORT_STALE_ROUNDS` rounds is
left out, and logged (docs/autoscaling.md says why the replicas push rather than the autoscaler pulling).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import ray
from ray import serve
from ray.actor import ActorHandle

from actors.serving.server import InstanceInfo, InstanceServer
from cluster.autoscale import (AUTOSCALED_PREFIX, AutoscalePolicy, AutoscaleStatus, AutoscalingConfig, Cause,
                               ScaleDecision, ScaleEvent, SignalReader)
from cluster.config import FleetConfig, SpecfleetConfig
from cluster.disagg import Role
from cluster.first_token import TtftReport, TtftReports
from cluster.instances import InstanceRow
from cluster.router import INSTANCE_ACTOR_PREFIX, NAMESPACE, get_or_create_router
from cluster.router_client import RouterClient
from cluster.stats import FailedRounds
from deploy.serve.fleet import replan
from placement.fleet import InstanceSpec
from placement.planner import PlacementError

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 900.0  # for a new instance to load its models (as deploy/serve/app.py's), on KubeRay its pod to join
CALL_TIMEOUT_S = 30.0
# after the router counts no request on a drained instance, the streams that moved off it may still be reading their
# last item from it (the one that says where they went): it stops this much later, so none of them fails over
STOP_GRACE_S = 2.0
MAX_EVENTS = 100
ROUND = "autoscale"  # the loop's name in its FailedRounds
# an API replica's TTFT report older than this many rounds (and at least REPORT_STALE_MIN_S) is left out of a round
REPORT_STALE_ROUNDS, REPORT_STALE_MIN_S = 3, 5.0


@dataclass(frozen=True)
class Launched:
    """An instance started and loaded, not yet registered."""

    spec: InstanceSpec
    server: ActorHandle
    info: InstanceInfo
    start_s: float


class Launcher(Protocol):
    async def launch(self, instance_id: str, index: int, taken: set[tuple[str, int]], role: Role = "both") -> Launched:
        """Start instance `instance_id` (the `index`-th the autoscaler started) on devices not in `taken`, with its
        disaggregation `role` in its spec (it reports it to a router that restarts). It adds the devices it takes to
        `taken` before it waits for the load: launches side by side share the set."""
        ...


class PlannedLauncher:
    """Starts instances as the deployed fleet's are: `template` (a planned spec of the fleet, its engine resolved)
    planned again for the new id over the live nodes' free devices, spawned with the fleet's resources."""

    def __init__(self, template: InstanceSpec, fleet_cfg: FleetConfig) -> None:
        self.template = template
        self.fleet_cfg = fleet_cfg
        self._planning = asyncio.Lock()  # one plan at a time: each sees the devices the ones before it took

    async def launch(self, instance_id: str, index: int, taken: set[tuple[str, int]], role: Role = "both") -> Launched:
        began = time.monotonic()
        spec = self.template.model_copy(update={"instance_id": instance_id, "role": role})
        async with self._planning:
            try:
                placed = await asyncio.to_thread(replan, spec, self.fleet_cfg, index, taken)
            except PlacementError as full:  # on KubeRay: on a pod to come, which Ray's autoscaler adds for it
                try:
                    placed = await asyncio.to_thread(replan, spec, self.fleet_cfg, index, taken, True)
                except PlacementError:
                    raise PlacementError(f"{full}; and no KubeRay worker group below its maxReplicas to add a pod "
                                         "to") from None
                log.warning("autoscaler: no room on the live nodes (%s); %s waits for a new pod of its group on %s",
                            full, instance_id, placed.place)
            taken.update(placed.layout.places)
        name = f"{INSTANCE_ACTOR_PREFIX}{instance_id}/{uuid.uuid4().hex[:8]}"  # a restarted router finds it by name
        # detached: owned by no process, so it outlives the autoscaler replica that started it (Serve replaces that
        # replica when it fails; the streams on the instance go on, and the new replica adopts it)
        server = InstanceServer.spawn(placed, resources={**InstanceServer.pin(placed),
                                                         **self.fleet_cfg.instance_resources},
                                      name=name, namespace=NAMESPACE, lifetime="detached")
        try:
            info = await asyncio.wait_for(server.info.remote(), LOAD_TIMEOUT_S)  # its models load here
        except BaseException:
            ray.kill(server, no_restart=True)
            raise
        return Launched(placed, server, info, time.monotonic() - began)


class Autoscaler:
    """One decision per `tick`, carried out before the next; a step of several instances starts (or drains) them
    side by side."""

    def __init__(self, cfg: AutoscalingConfig, slots_per_instance: int, router: RouterClient, launcher: Launcher,
                 clock=time.monotonic, floor: int | None = None) -> None:
        self.cfg = cfg
        # the deployed instances (Serve's); while fewer are registered (starting, or being replaced by Serve) they
        # count as starting: the autoscaler waits for them rather than starting others in their place
        self.floor = cfg.min_instances if floor is None else floor
        self.policy = AutoscalePolicy(cfg, slots_per_instance)
        self.reader = SignalReader(cfg.window_s, slots_per_instance)
        # the API replicas' measured first tokens (pushed to `report_ttft`), the TTFT signal when there are any
        self.reports = TtftReports(cfg.window_s, max(REPORT_STALE_MIN_S, REPORT_STALE_ROUNDS * cfg.interval_s))
        self.router = router
        self.launcher = launcher
        self.clock = clock
        self.servers: dict[str, ActorHandle] = {}  # the instances this autoscaler started and runs
        self.events: collections.deque[ScaleEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.last: ScaleDecision | None = None
        self.size = 0
        self.failed = FailedRounds()  # rounds that raised (status, /metrics)

    async def run(self) -> None:
        """Decide and act every `interval_s`, for good; a failed round is logged with its cause and the next runs."""
        while True:
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - a failed round (the router away) must not stop autoscaling
                self.failed.record(ROUND, e)  # counted: a defect failing every round shows in /metrics and status
                log.exception("an autoscaling round failed")
            await asyncio.sleep(self.cfg.interval_s)

    async def tick(self) -> ScaleDecision:
        rows, start_s = await asyncio.gather(self._rows(), self._start_s())
        now = self.clock()
        await self.adopt(rows)
        deployed = sum(not r.instance_id.startswith(AUTOSCALED_PREFIX) for r in rows if r.healthy)
        self.reports.prune(now)
        signal = self.reader.read(rows, now, starting=max(0, self.floor - deployed), start_s=start_s,
                                  measured=self.reports.measured(now))
        decision = self.last = self.policy.decide(signal, now)
        self.size = signal.size
        try:
            if decision.action == "up":
                await self.scale_out(decision.reason, rows, decision.role, decision.cause, decision.count)
            elif decision.action == "down":
                await self.scale_in_all(decision.remove, decision.reason, decision.cause)
        finally:
            if decision.action != "hold":
                self.policy.done(self.clock())
        return decision

    async def adopt(self, rows: list[InstanceRow]) -> list[str]:
        """Take charge of the autoscaled instances the router lists that this autoscaler did not start (a replica
        before it did, and died: they are detached, so they lived on); they are then stopped with the others when
        the app goes. The ids adopted."""
        adopted = []
        for r in rows:
            if r.instance_id.startswith(AUTOSCALED_PREFIX) and r.instance_id not in self.servers:
                server = await _find_instance(r.instance_id, r.incarnation)
                if server is not None:
                    self.servers[r.instance_id] = server
                    adopted.append(r.instance_id)
        if adopted:
            log.warning("autoscaler: adopted %s, started by an autoscaler before this one", ", ".join(adopted))
        return adopted

    def report_ttft(self, report: TtftReport) -> None:
        """An API replica's record of its recent first tokens and requests waiting for one (its latest replaces the
        one before)."""
        self.reports.put(report, self.clock())

    def status(self) -> AutoscaleStatus:
        now = self.clock()
        measured = self.reports.measured(now)
        ttft, source = self.reader.ttft_p99(now, measured)  # as a round would take it now: measured, or predicted
        return AutoscaleStatus(self.cfg.min_instances, self.cfg.max_instances, self.size, self.last,
                               tuple(self.events), tuple((a, o, c, n) for (a, o, c), n in sorted(self.counts.items())),
                               ttft, self.reader.itl.p99(now), self.failed.counts.get(ROUND, 0),
                               self.failed.last_error.get(ROUND, ""), source,
                               0 if measured is None else measured.replicas)

    # ---- scale out ---------------------------------------------------------------------------------------------
    async def scale_out(self, reason: str, rows: list[InstanceRow], role: Role = "both", cause: Cause = "manual",
                        count: int = 1) -> tuple[ScaleEvent, ...]:
        """Start the next `count` `auto-N` instances on free devices, side by side, and register each with `role`
        (prefill, decode or both); `cause`: the decision's, recorded with each step. One event per instance: one
        that fails to start is recorded as failed, the others go on."""
        used = [int(r.instance_id[len(AUTOSCALED_PREFIX):]) for r in rows
                if r.instance_id.startswith(AUTOSCALED_PREFIX) and r.instance_id[len(AUTOSCALED_PREFIX):].isdigit()]
        first = max([*used, *(int(i[len(AUTOSCALED_PREFIX):]) for i in self.servers), -1]) + 1
        # the devices the fleet holds; each launch adds the ones it takes, so side-by-side starts never share one
        taken = set().union(*(r.place.places for r in rows))
        return tuple(await asyncio.gather(*(self._start(first + n, taken, role, reason, cause)
                                            for n in range(count))))

    async def _start(self, index: int, taken: set[tuple[str, int]], role: Role, reason: str,
                     cause: Cause) -> ScaleEvent:
        """Start, load and register instance `auto-<index>`; its event, done or failed (never raised)."""
        at, began = time.time(), self.clock()
        instance_id = f"{AUTOSCALED_PREFIX}{index}"
        log.warning("autoscaler: starting %s (%s)", instance_id, reason)
        try:
            await self.router.call(lambda r: r.starting.remote(instance_id), timeout_s=CALL_TIMEOUT_S)
            got = await self.launcher.launch(instance_id, index, taken, role)
            self.servers[instance_id] = got.server
            i = got.info
            await self.router.call(lambda r: r.register.remote(instance_id, got.server, i.model, i.max_model_len,
                                                               i.node_id, got.spec.place, i.actor_id, got.start_s,
                                                               i.backend, role=role), timeout_s=CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - recorded as a failed step, with its cause; the policy decides again
            log.exception("autoscaler: starting %s failed", instance_id)
            server = self.servers.pop(instance_id, None)
            if server is not None:
                ray.kill(server, no_restart=True)
            return self._record(ScaleEvent(at, "up", instance_id, reason, "failed", f"{type(e).__name__}: {e}",
                                           self.clock() - began, cause=cause))
        return self._record(ScaleEvent(at, "up", instance_id, reason, "done", duration_s=self.clock() - began,
                                       cause=cause))

    # ---- scale in ----------------------------------------------------------------------------------------------
    async def scale_in_all(self, instance_ids: tuple[str, ...], reason: str,
                           cause: Cause = "manual") -> tuple[ScaleEvent, ...]:
        """Scale in `instance_ids` side by side. Each is first taken out of dispatch, so that no drain moves a
        request onto another instance that is leaving; then each drains and stops as `scale_in` does."""
        for instance_id in instance_ids:  # all of them before any drain moves a request
            await self.router.call(lambda r, i=instance_id: r.drain.remote(i), timeout_s=CALL_TIMEOUT_S)
        return tuple(await asyncio.gather(*(self.scale_in(i, reason, cause) for i in instance_ids)))

    async def scale_in(self, instance_id: str, reason: str, cause: Cause = "manual") -> ScaleEvent:
        """Drain `instance_id` through migration until the router counts nothing on it, then stop it; within
        `drain_timeout_s`, else put it back in service."""
        at, began = time.time(), self.clock()
        deadline = began + self.cfg.drain_timeout_s
        migrated, row = 0, None
        log.warning("autoscaler: draining %s through migration (%s)", instance_id, reason)
        while True:
            left = max(1.0, deadline - self.clock())
            drained = await self.router.call(lambda r: r.drain_migrate.remote(instance_id), timeout_s=left,
                                             retry=False)
            migrated += drained.migrated
            row = next((r for r in await self._rows() if r.instance_id == instance_id), None)
            if row is None:
                return self._record(ScaleEvent(at, "down", instance_id, reason, "failed", "it left the fleet while "
                                               "it drained (failed health)", self.clock() - began, migrated, cause))
            if row.in_flight == 0:
                break
            if self.clock() > deadline:
                await self.router.call(lambda r: r.undrain.remote(instance_id), timeout_s=CALL_TIMEOUT_S)
                why = "; ".join(drained.not_moved) or f"{row.in_flight} requests still on it"
                return self._record(ScaleEvent(at, "down", instance_id, reason, "cancelled",
                                               f"not drained within {self.cfg.drain_timeout_s:g} s ({why}): back in "
                                               "service", self.clock() - began, migrated, cause))
            await asyncio.sleep(0.2)
        await asyncio.sleep(STOP_GRACE_S)
        server = self.servers.pop(instance_id, None) or await _find_instance(instance_id, row.incarnation)
        kv = await asyncio.wait_for(server.kv_blocks_used.remote(), CALL_TIMEOUT_S) if server is not None else (0, 0)
        await self.router.call(lambda r: r.deregister.remote(instance_id, row.incarnation), timeout_s=CALL_TIMEOUT_S)
        if server is not None:
            ray.kill(server, no_restart=True)
        detail = "" if tuple(kv) == (0, 0) else f"it still held KV blocks {tuple(kv)} (target, draft) when stopped"
        return self._record(ScaleEvent(at, "down", instance_id, reason, "done", detail, self.clock() - began,
                                       migrated, cause))

    # ---- helpers -------------------------------------------------------------------------------------------------
    async def _rows(self) -> list[InstanceRow]:
        return await self.router.call(lambda r: r.instances.remote(), timeout_s=CALL_TIMEOUT_S)

    async def _start_s(self) -> float | None:
        """How long a new instance takes to serve, as the router learned it from the starts it saw (the deployed
        ones' and this autoscaler's, cluster/start_times.py): the predictive step up's horizon."""
        if not self.cfg.predict:
            return None
        return (await self.router.failover_wait(timeout_s=CALL_TIMEOUT_S)).expected_start_s

    def _record(self, event: ScaleEvent) -> ScaleEvent:
        self.events.append(event)
        self.counts[(event.action, event.outcome, event.cause)] += 1
        log.warning("autoscaler: %s %s %s in %.1f s (%s)%s", event.action, event.instance_id, event.outcome,
                    event.duration_s, event.reason, f": {event.detail}" if event.detail else "")
        return event

    def stop_all(self) -> None:
        """Stop the instances this autoscaler started (the app is being deleted)."""
        for server in self.servers.values():
            ray.kill(server, no_restart=True)
        self.servers.clear()


async def _find_instance(instance_id: str, incarnation: str) -> ActorHandle | None:
    """The named instance actor of `instance_id` (one a previous autoscaler started), None if none is alive."""
    named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
    prefix = f"{INSTANCE_ACTOR_PREFIX}{instance_id}/"
    for a in named:
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix):
            handle = await asyncio.to_thread(ray.get_actor, a["name"], namespace=NAMESPACE)
            if not incarnation or handle._actor_id.hex() == incarnation:
                return handle
    return None


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=2.0, max_ongoing_requests=100)
class SpecfleetAutoscaler:
    """The autoscaler as one Serve replica: its loop is started (and watched) from Serve's health checks."""

    def __init__(self, cfg: SpecfleetConfig, template: InstanceSpec) -> None:
        if cfg.fleet.autoscaling is None:
            raise ValueError("SpecfleetAutoscaler needs fleet.autoscaling")
        router = RouterClient.resolving(lambda: get_or_create_router(cfg.router), reconnect_s=cfg.router.reconnect_s)
        self.autoscaler = Autoscaler(cfg.fleet.autoscaling, cfg.engine.scheduler.max_batch_size, router,
                                     PlannedLauncher(template, cfg.fleet), floor=cfg.fleet.instances)
        self._loop: asyncio.Task | None = None

    async def check_health(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self.autoscaler.run())
        elif self._loop.done():  # it runs for good: an end is a defect; Serve replaces this replica
            raise RuntimeError(f"the autoscaling loop ended: {self._loop.exception()!r}")

    async def status(self) -> AutoscaleStatus:
        return self.autoscaler.status()

    async def report_ttft(self, report: TtftReport) -> None:
        """An API replica's measured first tokens (deploy/serve/ttft_reporter.py), for the next round."""
        self.autoscaler.report_ttft(report)

    def __del__(self) -> None:
        try:
            self.autoscaler.stop_all()
        except Exception:  # noqa: BLE001 - best effort at teardown; the router drops instances that vanish
            log.warning("could not stop the autoscaled instances at shutdown")
