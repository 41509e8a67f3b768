"""The router's state without Ray: instances with their latest stats, and the request table.

The router actor (cluster/router.py) wraps one Registry and adds handles and polling. Everything here is
plain data, so dispatch, draining and failure handling are tested without a cluster.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from cluster.dispatch import DispatchPolicy, InstanceView, ListFleet
from cluster.instances import InstancePlace, InstanceRow, RequestRow
from cluster.load_order import LoadOrder
from cluster.prefix import BlockHash
from cluster.prefix_index import PrefixIndex
from cluster.request import RequestStatus
from cluster.stats import EngineStats


class NoInstanceAvailable(RuntimeError):
    """No healthy instance accepts requests (none registered, all unhealthy, or all draining)."""


@dataclass(frozen=True)
class Reconciled:
    """A request the router closed because its instance no longer holds it (its release never arrived)."""

    request_id: str
    instance_id: str
    status: RequestStatus
    seen_by_instance: bool  # False: the instance never received it (it was routed, then never sent)


@dataclass
class InstanceEntry:
    """One registered instance as the router knows it."""

    instance_id: str
    model: str
    node: str  # where its engine runs (a node name or id), for operators
    registered_at: float
    stats: EngineStats | None = None
    healthy: bool = True
    error: str | None = None
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    last_seen: float = 0.0
    place: InstancePlace = InstancePlace()
    incarnation: str = ""  # its actor's id: a replacement registers under the same instance id with another
    backend: str = ""  # the path its target model runs on and why (actors/model/backends.py BackendPlan.describe)

    @property
    def accepting(self) -> bool:
        """Whether dispatch may send it new requests."""
        return self.healthy and not self.draining

    def view(self, cached_blocks: int = 0) -> InstanceView:
        return InstanceView(self.instance_id, self.stats, len(self.in_flight), self.draining, cached_blocks)

    def row(self, removed_at: float | None = None) -> InstanceRow:
        return InstanceRow(instance_id=self.instance_id, model=self.model, node=self.node, healthy=self.healthy,
                           error=self.error, draining=self.draining, accepting=self.accepting,
                           in_flight=len(self.in_flight), stats=self.stats,
                           age_s=round(time.time() - self.registered_at, 3), place=self.place, removed_at=removed_at,
                           incarnation=self.incarnation, backend=self.backend)


@dataclass
class RequestEntry:
    """One row of the request table."""

    request_id: str
    instance_id: str
    priority: int
    status: RequestStatus
    created_at: float
    finished_at: float | None = None
    ended_at_instance: RequestStatus | None = None  # what the last poll's instance reported, not yet confirmed

    def row(self) -> RequestRow:
        return RequestRow(request_id=self.request_id, instance_id=self.instance_id, priority=self.priority,
                          status=self.status.value, created_at=self.created_at, finished_at=self.finished_at)


class _IndexedFleet:
    """The accepting instances of one model as a dispatch policy reads them, from the registry's load order and
    prefix index: the least loaded in O(log n), the holders of a request's prefix deepest first."""

    PER_DEPTH = 64  # holders of one depth offered to the policy (a shared system prompt may be held by all)
    SCANNED = 256  # holders looked at in all: a route's cost stays bounded however widely its prefix is held

    def __init__(self, registry: "Registry", order: LoadOrder, model: str | None, blocks: Sequence[BlockHash]) -> None:
        self.registry, self.order, self.model, self.blocks = registry, order, model, blocks
        self.request_blocks = len(blocks)
        self.cached: dict[str, int] = {}  # what `holders` offered: instance -> leading blocks held

    def least_loaded(self) -> InstanceView:
        instance_id = self.order.first()
        return self.registry.instances[instance_id].view(self.cached.get(instance_id, 0))

    def views(self) -> list[InstanceView]:
        return [e.view(self.cached.get(e.instance_id, 0)) for e in self.registry.instances.values()
                if e.instance_id in self.order]

    def holders(self) -> Iterator[InstanceView]:
        least, scanned = self.order.first(), 0
        for depth, instances in self.registry.prefix.deepest(self.blocks):
            if least in instances and least not in self.cached:
                self.cached[least] = depth
                yield self.registry.instances[least].view(depth)
            offered = 0
            for instance_id in instances:
                scanned += 1
                if scanned > self.SCANNED:
                    return
                if instance_id in self.order and instance_id not in self.cached:
                    self.cached[instance_id] = depth
                    yield self.registry.instances[instance_id].view(depth)
                    offered += 1
                    if offered == self.PER_DEPTH:
                        break


class Registry:
    """Instances and requests; `route` applies the dispatch policy to the healthy, non-draining instances."""

    def __init__(self, policy: DispatchPolicy, keep_finished: int = 1000, prefix: PrefixIndex | None = None) -> None:
        self.prefix = prefix or PrefixIndex()  # which instance holds which KV blocks (cache-aware dispatch)
        self.decisions: Counter[str] = Counter()  # routing decisions by reason (see `route`)
        self._orders: dict[str | None, LoadOrder] = {None: LoadOrder()}  # accepting instances by load, per model
        self._policy = policy
        self.instances: dict[str, InstanceEntry] = {}
        self.requests: dict[str, RequestEntry] = {}
        self.keep_finished = keep_finished  # finished rows kept for `specfleet requests`, oldest dropped first
        self._finished_order: list[str] = []

    @property
    def policy(self) -> DispatchPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: DispatchPolicy) -> None:
        """Another dispatch policy (a redeployed app's): its load keys order the instances from now on."""
        self._policy = policy
        self._orders = {None: LoadOrder()}
        for entry in self.instances.values():
            self._touch(entry)

    def _touch(self, entry: InstanceEntry) -> None:
        """Keep the load orders current after anything that changes an instance's load or whether it accepts."""
        orders = (self._orders[None], self._orders.setdefault(entry.model, LoadOrder()))
        if entry.accepting and self.instances.get(entry.instance_id) is entry:
            key = self._policy.load_key(entry.view())
            for order in orders:
                order.set(entry.instance_id, key)
        else:
            for order in orders:
                order.discard(entry.instance_id)

    # ---- instances --------------------------------------------------------------------------
    def register(self, instance_id: str, model: str, node: str, now: float,
                 place: InstancePlace = InstancePlace(), incarnation: str = "", backend: str = "") -> InstanceEntry:
        """Add an instance (or revive one that registers again after a router restart, or its replacement: the
        requests routed to the one it replaces stay counted until they fail over or are reconciled)."""
        entry = InstanceEntry(instance_id, model, node, registered_at=now, last_seen=now, place=place,
                              incarnation=incarnation, backend=backend)
        self.prefix.drop_instance(instance_id)  # what it holds comes again with its first batch: a snapshot
        old = self.instances.get(instance_id)
        if old is not None:
            entry.in_flight = old.in_flight
        self.instances[instance_id] = entry
        self._touch(entry)
        return entry

    def update(self, instance_id: str, stats: EngineStats, healthy: bool, error: str | None, now: float) -> None:
        entry = self.instances.get(instance_id)
        if entry is None:
            return
        entry.stats, entry.healthy, entry.error, entry.last_seen = stats, healthy, error, now
        self._touch(entry)

    def mark_unhealthy(self, instance_id: str, error: str) -> list[str]:
        """Take an instance out of dispatch; returns its in-flight requests (they end with its error)."""
        entry = self.instances.get(instance_id)
        if entry is None:
            return []
        entry.healthy, entry.error = False, error
        self._touch(entry)
        return sorted(entry.in_flight)

    def remove(self, instance_id: str, now: float) -> InstanceEntry | None:
        """Take an instance out of the registry; the requests still running there are closed as failed (no poll
        visits them any more: reconciliation asks instances, and this one is gone). A request that fails over
        afterwards is running again where it resumes (`reroute`)."""
        self.prefix.drop_instance(instance_id)
        entry = self.instances.pop(instance_id, None)
        if entry is not None:
            self._touch(entry)
            for rid in sorted(entry.in_flight):
                self.finish(rid, RequestStatus.FAILED, now)
        return entry

    def adopt(self, request_id: str, instance_id: str, priority: int, now: float) -> RequestEntry:
        """Record a request as running at `instance_id` without routing it: one a (re)started router learns from the
        instance that runs it, or one that fails over to it and that the router never saw."""
        entry = self.requests.get(request_id)
        if entry is not None and entry.status == RequestStatus.RUNNING:
            self.rehome(request_id, instance_id)
            return entry
        if entry is not None and request_id in self._finished_order:
            self._finished_order.remove(request_id)
        entry = self.requests[request_id] = RequestEntry(request_id, instance_id, priority, RequestStatus.RUNNING, now)
        self.instances[instance_id].in_flight.add(request_id)
        self._touch(self.instances[instance_id])
        return entry

    def set_draining(self, instance_id: str, draining: bool = True) -> InstanceEntry:
        entry = self.instances.get(instance_id)
        if entry is None:
            raise KeyError(instance_id)
        entry.draining = draining
        self._touch(entry)
        return entry

    def models(self) -> list[str]:
        return sorted({e.model for e in self.instances.values() if e.healthy})

    # ---- requests ---------------------------------------------------------------------------
    def route(self, request_id: str, priority: int, now: float, model: str | None = None,
              blocks: Sequence[BlockHash] = ()) -> str:
        """Choose an instance for a new request and record it as running there. `blocks` names the full KV blocks
        of its prompt (cluster/prefix.py): a cache-aware policy sees how many leading ones each instance holds,
        and they count at the chosen instance at once (provisionally, until its events confirm them).

        Each decision is counted by reason in `decisions`: `prefix` (sent where part of its prompt is cached),
        `load_over_prefix` (an instance held part of it but was too loaded), `load` (no instance held any)."""
        if request_id in self.requests and self.requests[request_id].status == RequestStatus.RUNNING:
            raise ValueError(f"request id {request_id!r} is already running")
        order = self._orders.get(model)
        if not order:
            raise NoInstanceAvailable(self._why_none(model))
        fleet = _IndexedFleet(self, order, model, blocks)
        instance_id = self._policy.choose(fleet)
        self._decided(instance_id, fleet.cached, blocks, now)
        entry = self.instances[instance_id]
        entry.in_flight.add(request_id)
        self._touch(entry)
        self.requests[request_id] = RequestEntry(request_id, instance_id, priority, RequestStatus.RUNNING, now)
        return instance_id

    def _decided(self, instance_id: str, cached: dict[str, int], blocks: Sequence[BlockHash], now: float) -> None:
        """Count a routing decision by reason; the request's blocks count at its instance from now (provisionally)."""
        self.decisions["prefix" if cached.get(instance_id) else "load_over_prefix" if cached else "load"] += 1
        if blocks:
            self.prefix.routed(instance_id, blocks, now)

    def finish(self, request_id: str, status: RequestStatus, now: float) -> RequestEntry | None:
        entry = self.requests.get(request_id)
        if entry is None or entry.status != RequestStatus.RUNNING:
            return entry
        entry.status, entry.finished_at = status, now
        inst = self.instances.get(entry.instance_id)
        if inst is not None:
            inst.in_flight.discard(request_id)
            self._touch(inst)
        self._finished_order.append(request_id)
        while len(self._finished_order) > self.keep_finished:
            self.requests.pop(self._finished_order.pop(0), None)
        return entry

    def reconcile(self, instance_id: str, asked: list[str], states: dict[str, RequestStatus], now: float,
                  grace_s: float, moving: Collection[str] = ()) -> list[Reconciled]:
        """Close the requests routed to `instance_id` that the instance no longer runs or queues.

        `states` is the instance's answer for the ids the router `asked` about (its requests in flight when
        the poll began): RUNNING while it holds a request, its final status once it ended; an id it does
        not know is absent. A request it reports
        ended is closed with that status. One it does not know is closed as aborted once it was routed more
        than `grace_s` ago (it never reached the instance: its caller went away between `route` and sending
        it); before that it may still be on its way. A request in `moving` (a live migration under way) is left
        alone: its source lets go of it before the router rehomes it, and an answer from between the two must
        not close it.
        """
        inst = self.instances.get(instance_id)
        if inst is None:
            return []
        closed = []
        for rid in asked:
            entry = self.requests.get(rid)
            if rid not in inst.in_flight or entry is None or entry.status != RequestStatus.RUNNING or rid in moving:
                continue  # released or moving meanwhile
            state = states.get(rid)
            if state == RequestStatus.RUNNING:
                continue
            if state is None and now - entry.created_at <= grace_s:
                continue
            if state is not None and entry.ended_at_instance is None:
                entry.ended_at_instance = state
                continue
            status = state or RequestStatus.ABORTED
            self.finish(rid, status, now)
            closed.append(Reconciled(rid, instance_id, status, seen_by_instance=state is not None))
        return closed

    def choose(self, exclude: set[str], model: str | None = None, cached: dict[str, int] | None = None,
               request_blocks: int = 0) -> str:
        """Where dispatch would send a request now, leaving out `exclude`; NoInstanceAvailable if nowhere. `cached`:
        how many of the request's `request_blocks` leading blocks each instance holds (PrefixIndex.match), for a
        cache-aware policy."""
        cached = cached or {}
        views = [e.view(cached.get(e.instance_id, 0)) for e in self.instances.values()
                 if e.accepting and e.instance_id not in exclude and (model is None or e.model == model)]
        if not views:
            raise NoInstanceAvailable(self._why_none(model) if len(exclude) < len(self.instances)
                                      else "no other instance is left")
        return self._policy.choose(ListFleet(views, self._policy.load_key, request_blocks))

    def rehome(self, request_id: str, instance_id: str) -> None:
        """A request now runs at `instance_id` (it migrated there, or resumed there after a failure)."""
        entry = self.requests[request_id]
        old = self.instances.get(entry.instance_id)
        if old is not None:
            old.in_flight.discard(request_id)
            self._touch(old)
        self.instances[instance_id].in_flight.add(request_id)
        self._touch(self.instances[instance_id])
        entry.instance_id, entry.ended_at_instance = instance_id, None

    def reroute(self, request_id: str, exclude: set[str], now: float, model: str | None = None,
                priority: int = 0, blocks: Sequence[BlockHash] = ()) -> str:
        """Failover: choose another instance for a request whose instance failed, and move it there (running
        again if the failure had already closed it; recorded afresh if this router never knew it, e.g. it
        restarted after the instance died). `blocks` names the full blocks of its tokens so far (prompt and
        output), as for `route`: where they are cached it re-prefills less. NoInstanceAvailable if none is left."""
        cached = {i: n for i, n in self.prefix.match(blocks).items() if i not in exclude} if blocks else {}
        instance_id = self.choose(exclude, model, cached, len(blocks))
        self._decided(instance_id, cached, blocks, now)
        entry = self.requests.get(request_id)
        if entry is None:
            self.adopt(request_id, instance_id, priority, now)
            return instance_id
        if entry.status != RequestStatus.RUNNING:
            if request_id in self._finished_order:
                self._finished_order.remove(request_id)
            entry.status, entry.finished_at = RequestStatus.RUNNING, None
        self.rehome(request_id, instance_id)
        entry.created_at = now  # the grace before reconciliation counts from here
        return instance_id

    def pending(self) -> int:
        """Requests routed and not finished, over all instances (the backpressure count)."""
        return sum(len(e.in_flight) for e in self.instances.values())

    def _why_none(self, model: str | None) -> str:
        if not self.instances:
            return "no instance is registered yet"
        entries = [e for e in self.instances.values() if model is None or e.model == model]
        if not entries:
            return f"no instance serves model {model!r}"
        if all(not e.healthy for e in entries):
            return "every instance is unhealthy: " + "; ".join(f"{e.instance_id}: {e.error}" for e in entries)
        return "every healthy instance is draining"
