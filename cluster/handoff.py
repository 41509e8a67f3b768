"""The router's side of disaggregation: place a new request on a pair (`route_pair`, cluster/disagg.py's policy), then
watch each split request at its prefill instance and move it to its decode instance once its first token is out.

Why the router watches rather than the instance telling it: the router already reads an instance's per-request load
between two of its steps (`InstanceServer.load`, what the migration policies read); a request whose tokens now
outnumber its prompt has been prefilled. So the handoff needs no change to the instances, their protocol or the API's
stream, and costs one `load` call per prefill instance every `handoff_poll_s` while requests wait there (none
otherwise). The price: the prefill instance may decode a few more tokens (those within one poll, plus the staged
copies' time) before the request leaves; they stream to the client as any token does, and move with it.

No Ray here: the router injects how to read an instance's load and how to move a request (its `migrate`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from cluster.disagg import Candidate, DisaggPolicy, Placement, PromptShape, Role, prefilled
from cluster.migration_policy import InstanceLoad
from cluster.prefix import BlockHash
from cluster.registry import Registry
from cluster.request import RequestStatus

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
    (its client left before sending it; the router's reconciliation closes the request itself)."""

    def __init__(self, poll_s: float, load: Callable[[str], Awaitable[InstanceLoad]],
                 move: Callable[[str, str], Awaitable[object]], lost_after_s: float = 30.0) -> None:
        self.poll_s, self._load, self._move, self.lost_after_s = poll_s, load, move, lost_after_s
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
            except Exception:  # noqa: BLE001 - a failed round must not stop handoffs; the next one retries
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
