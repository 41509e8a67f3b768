"""Dispatch policies: which healthy instance a new request goes to (small named pure classes).

`least_load` follows Llumnix's "virtual usage" (OSDI '24, section 4.4.1) in its simplest form: the KV blocks
an instance holds plus the blocks its waiting queue will need, over its total, with a draining instance
counted as full. `round_robin` ignores load and cycles through instances in registration order.
"""

from __future__ import annotations

import itertools
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

    @property
    def capacity_blocks(self) -> int:
        return self.stats.kv_blocks_used + self.stats.kv_blocks_free if self.stats else 0

    def virtual_usage(self, blocks_per_request: float) -> float:
        """Fraction of the instance's KV that its running and queued requests claim (inf when draining)."""
        if self.draining:
            return float("inf")
        if self.stats is None or self.capacity_blocks == 0:
            return self.in_flight * blocks_per_request  # no stats yet: fall back on the request count
        queued = max(self.in_flight - self.stats.running, self.stats.waiting)
        return (self.stats.kv_blocks_used + queued * blocks_per_request) / self.capacity_blocks


class DispatchPolicy(Protocol):
    name: str

    def choose(self, instances: list[InstanceView]) -> str:
        """The id of the instance to dispatch to; `instances` is non-empty and holds only healthy ones."""
        ...


class LeastLoad:
    """The instance with the lowest virtual usage; ties go to the fewest requests in flight, then by id."""

    name = "least_load"

    def __init__(self, blocks_per_request: float = 8.0) -> None:
        self.blocks_per_request = blocks_per_request

    def choose(self, instances: list[InstanceView]) -> str:
        best = min(instances, key=lambda v: (v.virtual_usage(self.blocks_per_request), v.in_flight, v.instance_id))
        return best.instance_id


class RoundRobin:
    """Each instance in turn, skipping draining ones while another is available."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: list[InstanceView]) -> str:
        open_ = [v for v in instances if not v.draining] or instances
        return open_[next(self._counter) % len(open_)].instance_id


def make_dispatch(name: str) -> DispatchPolicy:
    policies = {"least_load": LeastLoad, "round_robin": RoundRobin}
    if name not in policies:
        raise ValueError(f"unknown dispatch policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]()
