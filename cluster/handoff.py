"""The router's side of disaggregation: place a new request on a pair (`route_pair`, cluster/disagg.py's policy), then
watch each split request at its prefill instance and move it to its decode instance once its first token is out.

Why the router watches rather than the instance telling it: the router already reads an instance's per-request load
between two of its steps (`InstanceServer.load`, what the migration policies read); a request whose tokens now
outnumber its prompt has been prefilled. So the handoff needs no change to the instances, their protocol or the API's
stream, and costs one `load` call per prefill instance every `handoff_poll_s` while requests wait there (none
otherwise). The price: the prefill instance may decode a few more tokens (those within one poll, plus the staged
copies' time) before the request leaves; they stream to the client as any token does, and move with it.

`Disaggregation` is what the router holds of it: each instance's role, the pair policy, the pending handoffs and their
figures. No Ray here: the router injects how to read an instance's load and how to move a request (its `migrate`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.disagg import ROLES, Candidate, DisaggConfig, DisaggPolicy, Placement, PromptShape, Role, prefilled
from cluster.migration_policy import InstanceLoad
from cluster.prefix import BlockHash
from cluster.registry import Registry
from cluster.request import RequestStatus
from cluster.stats import FailedRounds

if TYPE_CHECKING:
    from cluster.migration import MigrationResult

log = logging.getLogger(__name__)


@dataclass
class Handoff:
    """A request waiting at its prefill instance `source` for its first token, to move to `destination`."""

    request_id: str
    source: str
    destination: str
    prompt_tokens: int
    since: float  # monotonic time it was placed
    seen: bool = False  # its prefill instance has reported it (queued or running)


class Handoffs:
    """The pending handoffs and the supervised loop that starts them. `load(instance)`: that instance's per-request
    load (raises on a deadline); `move(request_id, destination)`: migrate it (the router's `migrate`, which records
    the outcome); `lost_after_s`: a handoff whose request its prefill instance has never reported this long is dropped
    (its client left before sending it; the router's reconciliation closes the request itself); `failed`: where a
    round that raised is counted (the router's figures)."""

    def __init__(self, poll_s: float, load: Callable[[str], Awaitable[InstanceLoad]],
                 move: Callable[[str, str], Awaitable[object]], lost_after_s: float = 30.0,
                 failed: FailedRounds | None = None) -> None:
        self.poll_s, self._load, self._move, self.lost_after_s = poll_s, load, move, lost_after_s
        self.failed = failed if failed is not None else FailedRounds()
        self.pending: dict[str, Handoff] = {}
        self._moving: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self.started = 0  # handoffs whose migration began
        self.dropped = 0  # handoffs given up: the request ended first, or was never seen

    def add(self, request_id: str, source: str, destination: str, prompt_tokens: int) -> None:
        self.pending[request_id] = Handoff(request_id, source, destination, prompt_tokens, time.monotonic())
        self._wake.set()

    def drop(self, request_id: str) -> None:
        """Forget a request's handoff (it ended, or its prefill instance failed and it failed over)."""
        self.pending.pop(request_id, None)

    def waiting_at(self, instance_id: str) -> int:
        return sum(h.source == instance_id for h in self.pending.values())

    async def run_forever(self) -> None:
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.round()
            except Exception as e:  # noqa: BLE001 - a failed round must not stop handoffs; the next retries (counted)
                self.failed.record("handoff", e)
                log.exception("a handoff round failed")
            await asyncio.sleep(self.poll_s)

    async def round(self) -> list[str]:
        """Read each prefill instance that holds pending handoffs once; start the handoff of every request there
        that has produced a token. Returns the request ids whose handoffs started."""
        sources = sorted({h.source for h in self.pending.values()})
        loads = await asyncio.gather(*(self._load(s) for s in sources), return_exceptions=True)
        now, started = time.monotonic(), []
        for source, load in zip(sources, loads):
            if isinstance(load, BaseException):  # health polling deals with an instance that does not answer
                log.debug("handoffs: reading %s failed (%s: %s)", source, type(load).__name__, load)
                for h in [h for h in self.pending.values() if h.source == source and now - h.since > self.lost_after_s]:
                    del self.pending[h.request_id]  # its instance is gone or stuck: the request fails over, or ends
                    self.dropped += 1
                continue
            running = {r.request_id: r.tokens for r in load.running}
            waiting = {r.request_id for r in load.waiting}
            for h in [h for h in self.pending.values() if h.source == source]:
                if h.request_id in running and prefilled(h.prompt_tokens, running[h.request_id]):
                    del self.pending[h.request_id]
                    self._start(h)
                    started.append(h.request_id)
                elif h.request_id in running or h.request_id in waiting:
                    h.seen = True
                elif h.seen or now - h.since > self.lost_after_s:  # it ended (or left) there before its first token
                    del self.pending[h.request_id]
                    self.dropped += 1
        return started

    def _start(self, h: Handoff) -> None:
        self.started += 1
        task = asyncio.get_running_loop().create_task(self._move(h.request_id, h.destination))
        self._moving.add(task)
        task.add_done_callback(lambda t: self._ended(t, h))

    def _ended(self, task: asyncio.Task, h: Handoff) -> None:
        self._moving.discard(task)
        if not task.cancelled() and task.exception() is not None:  # it ended or its instance left meanwhile
            e = task.exception()
            log.warning("handoff of %s from %s to %s not done: %s: %s", h.request_id, h.source, h.destination,
                        type(e).__name__, e)

    async def close(self) -> None:
        """Cancel the moves under way (the router is going away) and wait for them."""
        for task in list(self._moving):
            task.cancel()
        await asyncio.gather(*self._moving, return_exceptions=True)


def candidates(registry: Registry, roles: dict[str, Role], model: str | None,
               cached: dict[str, int]) -> list[Candidate]:
    """The accepting instances of `model` as the pair policy sees them: role, virtual usage (the dispatch policy's load
    key), requests in flight, and the leading blocks of the request each holds (`cached`)."""
    key = registry.policy.load_key
    return [Candidate(e.instance_id, roles.get(e.instance_id, "both"), key(e.view())[0], len(e.in_flight),
                      cached.get(e.instance_id, 0))
            for e in registry.instances.values() if e.accepting and (model is None or e.model == model)]


def route_pair(registry: Registry, policy: DisaggPolicy, roles: dict[str, Role], request_id: str, priority: int,
               now: float, model: str | None, blocks: Sequence[BlockHash], prompt: PromptShape | None) -> Placement:
    """Place a new request on a pair (cluster/disagg.py) and record it as running where it starts; the caller hands it
    off later if the placement says so. With no accepting instance, NoInstanceAvailable as plain dispatch says it."""
    cached = registry.prefix.match(blocks) if blocks else {}
    views = candidates(registry, roles, model, cached)
    if not views:  # plain dispatch raises NoInstanceAvailable, saying why
        return Placement(registry.route(request_id, priority, now, model, blocks), None, "no_candidate")
    placement = policy.place(views, prompt)
    registry.adopt(request_id, placement.first, priority, now)
    if blocks:  # they count where it prefills until that instance's events confirm them
        registry.prefix.routed(placement.first, blocks, now)
    return placement


def avoid_prefill_only(registry: Registry, roles: dict[str, Role], model: str | None, exclude: set[str]) -> set[str]:
    """`exclude` plus the `prefill` instances, when another accepting instance of `model` decodes: a failed-over
    request resumes (its prompt and tokens so far recomputed) where it will decode, not on a prefill instance it
    would stay on. With no such instance, `exclude` as given (a prefill instance is better than none)."""
    prefill_only = {i for i, r in roles.items() if r == "prefill"}
    if not prefill_only:
        return exclude
    left = [e for e in registry.instances.values() if e.accepting and e.instance_id not in exclude | prefill_only
            and (model is None or e.model == model)]
    return exclude | prefill_only if left else exclude


def handoff_destination(registry: Registry, policy: DisaggPolicy, roles: dict[str, Role], request_id: str,
                        destination: str) -> str | None:
    """Where a prefilled request moves: its planned decode instance while that one accepts, else the decode instance
    the policy picks now among the others (None if there is none, or the request no longer runs)."""
    entry = registry.requests.get(request_id)
    source = registry.instances.get(entry.instance_id) if entry is not None else None
    if entry is None or entry.status != RequestStatus.RUNNING or source is None:
        return None
    target = registry.instances.get(destination)
    if target is not None and target.accepting and destination != source.instance_id:
        return destination
    return policy.decode_instance(candidates(registry, roles, source.model, {}),
                                  exclude=frozenset({source.instance_id}))


class Disaggregation:
    """The router's disaggregation: each instance's role (absent: both), the pair policy, the pending handoffs, and
    the figures (new requests' placements by reason, handoffs' migrations by outcome). `load(instance)`: its
    per-request load, read with a deadline; `migrate(request_id, destination)`: the router's staged migration."""

    def __init__(self, cfg: DisaggConfig, registry: Registry, load: Callable[[str], Awaitable[InstanceLoad]],
                 migrate: Callable[[str, str], Awaitable[MigrationResult]], lost_after_s: float,
                 failed: FailedRounds | None = None) -> None:
        self.registry, self._migrate = registry, migrate
        self.policy = DisaggPolicy(cfg)
        self.roles: dict[str, Role] = {}
        self.handoffs = Handoffs(cfg.handoff_poll_s, load, self.hand_off, lost_after_s=lost_after_s, failed=failed)
        self.decisions: dict[str, int] = {}  # placements of new requests by reason (disaggregation on)
        self.results: dict[str, int] = {}  # handoffs' migrations by outcome

    def configure(self, cfg: DisaggConfig) -> None:
        self.policy = DisaggPolicy(cfg)
        self.handoffs.poll_s = cfg.handoff_poll_s

    def set_role(self, instance_id: str, role: Role) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} for instance {instance_id!r}; choose one of {', '.join(ROLES)}")
        self.roles[instance_id] = role

    def role(self, instance_id: str) -> Role:
        return self.roles.get(instance_id, "both")

    @property
    def split(self) -> bool:
        """Whether any instance has a prefill or decode role: then new requests are placed on pairs."""
        return any(r != "both" for r in self.roles.values())

    def route(self, request_id: str, priority: int, now: float, model: str | None, blocks: tuple[BlockHash, ...],
              prompt: PromptShape | None) -> str:
        """Place a new request on a pair (`route_pair`), count the decision, and queue its handoff if it splits."""
        placement = route_pair(self.registry, self.policy, self.roles, request_id, priority, now, model, blocks,
                               prompt)
        self.decisions[placement.reason] = self.decisions.get(placement.reason, 0) + 1
        if placement.decode is not None and prompt is not None:
            self.handoffs.add(request_id, placement.first, placement.decode, prompt.tokens)
        return placement.first

    async def hand_off(self, request_id: str, destination: str) -> MigrationResult | None:
        """Move a prefilled request to its decode instance (or another one if that one left or drains); it stays
        where it is when none can take it, or the move aborts (both counted)."""
        if request_id not in self.registry.requests:
            return None
        to = handoff_destination(self.registry, self.policy, self.roles, request_id, destination)
        result = None if to is None else await self._migrate(request_id, to)
        outcome = "no_decode_instance" if result is None else result.status.value
        self.results[outcome] = self.results.get(outcome, 0) + 1
        return result

    def resume_exclude(self, model: str | None, exclude: set[str]) -> set[str]:
        """Where a failed-over request must not resume: `exclude`, and prefill instances (`avoid_prefill_only`)."""
        return avoid_prefill_only(self.registry, self.roles, model, exclude)

    def figures(self) -> dict[str, int]:
        """Handoffs by outcome, and those given up because the request ended before its first token was seen."""
        dropped = {"ended_before_handoff": self.handoffs.dropped} if self.handoffs.dropped else {}
        return {**self.results, **dropped}
