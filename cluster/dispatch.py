"""Dispatch policies: which healthy instance a new request goes to (small named pure classes).

`least_load` follows Llumnix's "virtual usage" (OSDI '24, section 4.4.1) in its simplest form: the KV blocks
an instance holds plus the blocks its waiting queue will need, over its total, with a draining instance
counted as full. `round_robin` ignores load and cycles through instances in registration order.
`cache_aware` sends a request where the longest prefix of its prompt is already cached (the router's
prefix index, cluster/prefix_index.py, says how many leading blocks each instance holds) when that prefix is at
least `min_match` of the prompt (SGLang's cache-aware router's `cache_threshold`), unless that instance is
overloaded next to the least loaded one (more than `max_load_gap` of virtual usage above, or more than
`max_request_gap` more requests in flight): then least load decides, as llm-d's prefix-cache and load scorers and
SGLang's router trade the two.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from cluster.stats import EngineStats


@dataclass(frozen=True)
class InstanceView:
    """What a policy sees of one instance: its id, its latest stats, and the requests routed to it since."""

    instance_id: str
    stats: EngineStats | None  # None until the first poll
    in_flight: int  # requests routed to it and not finished (the router's own count, fresher than stats)
    draining: bool = False
    cached_blocks: int = 0  # leading blocks of the request being routed that it holds (the prefix index's count)

    @property
    def capacity_blocks(self) -> int:
        return self.stats.load.kv_blocks_used + self.stats.load.kv_blocks_free if self.stats else 0

    @property
    def queued(self) -> int:
        """Requests routed to it that it does not run yet (by the router's count when the stats lag behind)."""
        if self.stats is None:
            return self.in_flight
        return max(self.in_flight - self.stats.load.running, self.stats.load.waiting)

    def virtual_usage(self, blocks_per_request: float) -> float:
        """Fraction of the instance's KV that its running and queued requests claim (inf when draining)."""
        if self.draining:
            return float("inf")
        if self.stats is None or self.capacity_blocks == 0:
            return self.in_flight * blocks_per_request  # no stats yet: fall back on the request count
        return (self.stats.load.kv_blocks_used + self.queued * blocks_per_request) / self.capacity_blocks


LoadKey = tuple[float, int, str]


class Fleet(Protocol):
    """The accepting instances a request may go to, as a dispatch policy reads them (non-empty)."""

    def least_loaded(self) -> InstanceView:
        """The instance with the smallest load key (the policy's `load_key`)."""
        ...

    def views(self) -> list[InstanceView]:
        """Every instance, in registration order (costs O(n): for policies that must look at all)."""
        ...

    def holders(self) -> Iterator[InstanceView]:
        """Instances holding some of the request's prefix (cached_blocks > 0), most blocks first, the least
        loaded instance first among those of its depth; a fleet may bound how many of one depth it offers (the
        router's offers at most 64, in no particular order)."""
        ...

    @property
    def request_blocks(self) -> int:
        """Full KV blocks of the request's prompt (its names' count; 0 when it came without names)."""
        ...


class ListFleet:
    """A Fleet over a plain list of views (small fleets and tests); the router keeps an indexed one."""

    def __init__(self, views: list[InstanceView], key: Callable[[InstanceView], LoadKey],
                 request_blocks: int = 0) -> None:
        self._views, self._key, self.request_blocks = views, key, request_blocks

    def least_loaded(self) -> InstanceView:
        return min(self._views, key=self._key)

    def views(self) -> list[InstanceView]:
        return list(self._views)

    def holders(self) -> Iterator[InstanceView]:
        least = self.least_loaded().instance_id
        return iter(sorted((v for v in self._views if v.cached_blocks > 0),
                           key=lambda v: (-v.cached_blocks, v.instance_id != least)))


class DispatchPolicy(Protocol):
    name: str

    def load_key(self, view: InstanceView) -> LoadKey:
        """How loaded an instance is, smallest first (the fleet keeps instances ordered by it)."""
        ...

    def choose(self, fleet: Fleet) -> str:
        """The id of the instance to dispatch to, from the healthy, accepting instances of `fleet`."""
        ...


class LeastLoad:
    """The instance with the lowest virtual usage; ties go to the fewest requests in flight, then by id."""

    name = "least_load"

    def __init__(self, blocks_per_request: float = 8.0) -> None:
        self.blocks_per_request = blocks_per_request

    def load_key(self, view: InstanceView) -> LoadKey:
        return view.virtual_usage(self.blocks_per_request), view.in_flight, view.instance_id

    def choose(self, fleet: Fleet) -> str:
        return fleet.least_loaded().instance_id


class RoundRobin(LeastLoad):
    """Each instance in turn, skipping draining ones while another is available."""

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()

    def choose(self, fleet: Fleet) -> str:
        views = fleet.views()
        open_ = [v for v in views if not v.draining] or views
        return open_[next(self._counter) % len(open_)].instance_id


class CacheAware(LeastLoad):
    """The instance holding most of the request's prefix, at least `min_match` of its prompt's blocks, among those
    not overloaded next to the least loaded one (virtual usage at most `max_load_gap` above its, and at most
    `max_request_gap` more requests in flight); with no such holder, least load. Ties go to the lower usage, then
    the fewest in flight, then by id.

    Both bounds keep a popular prefix from piling requests on its holders. The match threshold: a prefix every
    request shares (a chat template's header, a block of the system prompt) would otherwise send everything to
    whoever served first. The request bound: KV usage alone lets one instance take a full batch and a queue before
    it looks loaded (measured: `specfleet bench prefix`, docs/benchmarks.md; and the router simulation)."""

    name = "cache_aware"

    def __init__(self, max_load_gap: float = 0.25, max_request_gap: int = 2, min_match: float = 0.5,
                 blocks_per_request: float = 8.0) -> None:
        super().__init__(blocks_per_request)
        self.max_load_gap, self.max_request_gap, self.min_match = max_load_gap, max_request_gap, min_match

    def choose(self, fleet: Fleet) -> str:
        least = fleet.least_loaded()
        ceiling = least.virtual_usage(self.blocks_per_request) + self.max_load_gap
        max_in_flight = least.in_flight + self.max_request_gap
        enough = max(1, math.ceil(self.min_match * fleet.request_blocks))
        best: InstanceView | None = None
        for v in fleet.holders():  # most cached blocks first: the first depth with a holder under the ceiling wins
            if v.cached_blocks < enough or best is not None and v.cached_blocks < best.cached_blocks:
                break
            if v.instance_id == least.instance_id:
                return v.instance_id  # no holder of this depth is less loaded
            key = self.load_key(v)
            if key[0] <= ceiling and v.in_flight <= max_in_flight and (best is None or key < self.load_key(best)):
                best = v
        return (best or least).instance_id


DISPATCH_POLICIES = ("least_load", "round_robin", "cache_aware")


def make_dispatch(name: str, max_load_gap: float = 0.25, max_request_gap: int = 2,
                  min_match: float = 0.5) -> DispatchPolicy:
    """The named policy; `max_load_gap` (a fraction of an instance's KV blocks), `max_request_gap` (requests in
    flight) and `min_match` (a fraction of the prompt's blocks) are cache_aware's margins."""
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(max_load_gap, max_request_gap, min_match)
    raise ValueError(f"unknown dispatch policy {name!r}; choose one of {', '.join(DISPATCH_POLICIES)}")
