"""Migration policies: which running request moves from which instance to which (Llumnix's global scheduler).

Llumnix (OSDI '24, arXiv 2406.03243, section 4.4) reschedules running requests between instances by their
"virtual usage", measured in KV blocks: the blocks running requests hold, plus the demand of requests queued
behind them (so an instance whose queue head fits nowhere looks loaded and is defragmented), plus a headroom
kept free on an instance that runs high-priority requests (so they decode with little interference), and
infinite usage on an instance being drained (so everything leaves it). Sources are paired with destinations
by usage, and the request to move is the cheapest one: the shortest, of the lowest priority.

Pure module, no Ray: the router feeds it plain `InstanceLoad`s and carries out the `Migration`s it returns
(through the migration coordinator in actors/). Four named policies, applied in this order by `plan`:

- `Drain`: every request of a draining instance goes to the accepting instance with the most room.
- `Queue`: a queued request that cannot start where it waits goes to an idle instance where it starts at once
  (a request that has not started holds no KV: Llumnix moves running requests, this moves waiting ones too).
- `Defrag`: an instance whose head-of-line queued request does not fit frees room by moving requests out.
- `Balance`: the most loaded instance (above `high_water`) gives its cheapest request to the least loaded
  (below `low_water`) when the move narrows the gap between them.

No policy ever moves a request toward an instance that is draining or not accepting, moves a request
already migrating, or sends a destination more blocks than it has free.

Roles (prefill/decode disaggregation, cluster/disagg.py): a prefill-only instance is never a destination (a moved
request decodes where it lands), and Defrag and Balance never take a request from one: its requests leave it
through the router's hand-off once they have their first token (cluster/handoff.py). Drain still empties it, and
Queue may move a request waiting there to a decode-capable instance that starts it at once (it then prefills
there, as a request the pair policy placed aggregated does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from cluster.disagg import Role


class MigrationPolicyConfig(BaseModel):
    """Thresholds of the global scheduler (fractions of an instance's KV blocks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    high_water: float = Field(default=0.8, gt=0.0, le=1.0)  # Balance: a source's usage is above this
    low_water: float = Field(default=0.5, ge=0.0, lt=1.0)  # Balance: a destination's usage is below this
    priority_headroom_blocks: int = Field(default=32, ge=0)  # kept free where a high-priority request runs
    max_per_round: int = Field(default=4, ge=1)  # migrations started per planning round


@dataclass(frozen=True)
class RequestLoad:
    """A request as the global scheduler sees it: its target KV blocks (held if it runs, needed if it is queued),
    priority, and tokens so far."""

    request_id: str
    blocks: int
    priority: int = 0  # higher is more important (the API's `priority`)
    tokens: int = 0
    max_blocks: int = 0  # what it would hold at its length limit (0: unknown, taken as `blocks`)

    @property
    def peak_blocks(self) -> int:
        return max(self.blocks, self.max_blocks)


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load in KV blocks: what it runs, what waits in its queue, and whether it takes work."""

    instance_id: str
    capacity_blocks: int
    running: tuple[RequestLoad, ...] = ()
    waiting: tuple[RequestLoad, ...] = ()  # queued requests (blocks: what each needs to start), head first
    draining: bool = False
    accepting: bool = True  # healthy and not draining: may receive requests
    max_running: int = 0  # requests it runs at once (its scheduler's max_batch_size); 0: no limit but blocks
    arriving: tuple[RequestLoad, ...] = ()  # moves toward it planned this round: they count, they do not move
    role: Role = "both"  # its disaggregation role (cluster/disagg.py): a `prefill` one is no destination

    @property
    def decodes(self) -> bool:
        """Whether a request may decode here (role `decode` or `both`)."""
        return self.role != "prefill"

    @property
    def waiting_blocks(self) -> tuple[int, ...]:
        return tuple(r.blocks for r in self.waiting)

    @property
    def used_blocks(self) -> int:
        return sum(r.blocks for r in self.running + self.arriving)

    def peak_blocks(self) -> int:
        """Blocks its running and arriving requests would hold at their length limits."""
        return sum(r.peak_blocks for r in self.running + self.arriving)

    def has_slot(self) -> bool:
        """Whether it may start one more request (blocks aside)."""
        return not self.max_running or len(self.running) + len(self.arriving) < self.max_running

    def stuck(self) -> RequestLoad | None:
        """The first queued request that cannot start in the next step (first come, first served: it and those
        behind it wait while it does not fit in the free blocks or the batch is full); None if none waits."""
        free = self.free_blocks
        slots = (self.max_running - len(self.running) - len(self.arriving)) if self.max_running else None
        for r in self.waiting:
            if r.blocks > free or slots == 0:
                return r
            free -= r.blocks
            slots = None if slots is None else slots - 1
        return None

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    def virtual_usage(self, headroom_blocks: int) -> float:
        """Llumnix's virtual usage as a fraction of capacity: held + head-of-line demand + priority headroom."""
        if self.draining:
            return float("inf")
        demand = self.waiting_blocks[0] if self.waiting_blocks else 0
        headroom = headroom_blocks if any(r.priority > 0 for r in self.running + self.arriving) else 0
        return (self.used_blocks + demand + headroom) / max(self.capacity_blocks, 1)


@dataclass(frozen=True)
class Migration:
    """Move `request_id` from `source` to `destination`; `reason` names the policy that asked."""

    request_id: str
    source: str
    destination: str
    blocks: int
    reason: str


class MigrationPolicy(Protocol):
    name: str

    def propose(self, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig) -> list[Migration]:
        """Migrations this policy wants, given the loads (which already reflect migrations planned before)."""
        ...


def cheapest_first(requests: Sequence[RequestLoad]) -> list[RequestLoad]:
    """The order in which requests are picked to move: lowest priority first, then the fewest blocks."""
    return sorted(requests, key=lambda r: (r.priority, r.blocks, r.request_id))


def _destinations(loads: Sequence[InstanceLoad], source: str, blocks: int, cfg: MigrationPolicyConfig
                  ) -> list[InstanceLoad]:
    """Accepting, decode-capable instances other than `source` with `blocks` free, least virtual usage first."""
    ok = [d for d in loads if d.accepting and not d.draining and d.decodes and d.instance_id != source
          and d.free_blocks >= blocks]
    return sorted(ok, key=lambda d: (d.virtual_usage(cfg.priority_headroom_blocks), d.instance_id))


def _move_cheapest(src: InstanceLoad, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig,
                   reason: str) -> list[Migration]:
    """The cheapest of `src`'s requests that some destination has room for, to the one with the most room."""
    for r in cheapest_first(src.running):
        dst = _destinations(loads, src.instance_id, r.blocks, cfg)
        if dst:
            return [Migration(r.request_id, src.instance_id, dst[0].instance_id, r.blocks, reason)]
    return []


class Drain:
    """Empty draining instances: each request, cheapest first, to the instance with the most room."""

    name = "drain"

    def propose(self, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig) -> list[Migration]:
        for src in loads:
            if src.draining and (move := _move_cheapest(src, loads, cfg, self.name)):
                return move
        return []


class Queue:
    """A queued request that cannot start where it is goes to an instance where it starts at once.

    It holds no KV yet (or only what a preemption left), so its move costs the handshake and little or no
    copy; it is what a dispatcher would have done had the destination been there when the request arrived (a
    scale-out). The destination must have no queue of its own, a free batch slot, and room for every request it
    runs to reach its length limit with this one: a request moved where growth would preempt it (and recompute
    it) loses more than it gains, and may then be moved back.
    """

    name = "queue"

    def propose(self, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig) -> list[Migration]:
        for src in loads:
            if (r := src.stuck()) is None:
                continue
            dst = [d for d in _destinations(loads, src.instance_id, r.blocks, cfg)
                   if not d.waiting and d.has_slot() and d.peak_blocks() + r.peak_blocks <= d.capacity_blocks]
            if dst:
                return [Migration(r.request_id, src.instance_id, dst[0].instance_id, r.blocks, self.name)]
        return []


class Defrag:
    """Make room for a queue head that does not fit: move out the cheapest requests until it would."""

    name = "defrag"

    def propose(self, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig) -> list[Migration]:
        for src in loads:
            if src.draining or not src.decodes or not src.waiting_blocks or src.waiting_blocks[0] <= src.free_blocks:
                continue  # (a prefill instance frees its room by handing requests off after their first token)
            if src.waiting_blocks[0] > src.capacity_blocks:
                continue  # it can never fit here; moving requests out would not help
            if move := _move_cheapest(src, loads, cfg, self.name):
                return move
        return []


class Balance:
    """Move the cheapest request from the most to the least loaded instance, when that narrows their gap."""

    name = "balance"

    def propose(self, loads: Sequence[InstanceLoad], cfg: MigrationPolicyConfig) -> list[Migration]:
        h = cfg.priority_headroom_blocks
        live = [x for x in loads if not x.draining and x.decodes and x.capacity_blocks > 0]
        sources = sorted((x for x in live if x.running and x.virtual_usage(h) > cfg.high_water),
                         key=lambda x: -x.virtual_usage(h))
        for src in sources:
            for r in cheapest_first(src.running):
                for dst in _destinations(loads, src.instance_id, r.blocks, cfg):
                    if dst.virtual_usage(h) >= cfg.low_water:
                        break  # sorted by usage: no lighter destination follows
                    after_src = replace(src, running=tuple(x for x in src.running if x is not r))
                    after_dst = replace(dst, running=dst.running + (r,))
                    if after_dst.virtual_usage(h) < src.virtual_usage(h) and \
                            abs(after_src.virtual_usage(h) - after_dst.virtual_usage(h)) < \
                            abs(src.virtual_usage(h) - dst.virtual_usage(h)):
                        return [Migration(r.request_id, src.instance_id, dst.instance_id, r.blocks, self.name)]
        return []


POLICIES: dict[str, type] = {"drain": Drain, "queue": Queue, "defrag": Defrag, "balance": Balance}


@dataclass
class Planner:
    """Applies the policies in order, round after round, as if each planned move had already happened."""

    policies: list[MigrationPolicy] = field(default_factory=lambda: [Drain(), Queue(), Defrag(), Balance()])
    cfg: MigrationPolicyConfig = MigrationPolicyConfig()

    def plan(self, loads: Sequence[InstanceLoad], migrating: frozenset[str] = frozenset()) -> list[Migration]:
        """Up to `max_per_round` migrations; requests in `migrating` (already on the move) are left alone, and
        each source and destination takes part in at most one KV-moving migration per round (as Llumnix pairs
        them); moves of queued requests, which carry no KV, are not limited that way."""
        state = {x.instance_id: replace(x, running=tuple(r for r in x.running if r.request_id not in migrating),
                                        waiting=tuple(r for r in x.waiting if r.request_id not in migrating))
                 for x in loads}
        busy: set[str] = set()
        out: list[Migration] = []
        while len(out) < self.cfg.max_per_round:
            view = [x for x in state.values() if x.instance_id not in busy]
            move = next((m for p in self.policies for m in p.propose(view, self.cfg)), None)
            if move is None:
                return out
            out.append(move)
            if move.reason != Queue.name:  # a queued request moves no KV: it occupies neither end's transfers
                busy.update((move.source, move.destination))
            src, dst = state[move.source], state[move.destination]
            req = next(r for r in src.running + src.waiting if r.request_id == move.request_id)
            state[move.source] = replace(src, running=tuple(r for r in src.running if r is not req),
                                         waiting=tuple(r for r in src.waiting if r is not req))
            # it counts at its destination from now on (a moved queued request starts there) but moves no further
            state[move.destination] = replace(dst, arriving=dst.arriving + (req,))
        return out


def make_planner(names: Sequence[str], cfg: MigrationPolicyConfig = MigrationPolicyConfig()) -> Planner:
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown migration policies {unknown}; choose from {', '.join(POLICIES)}")
    return Planner([POLICIES[n]() for n in names], cfg)
