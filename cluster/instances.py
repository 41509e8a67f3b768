"""Typed rows the router answers with: an instance's place (its stages and draft on devices), load and health; a
request's row in its table; what a drain did. The admin API sends them as JSON, and the CLI's client reads them back."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from cluster.stats import EngineStats


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer server may add fields


class StagePlace(_Row):
    """One target pipeline stage: layers [start, end) on accelerator `device` (its index there) of node `node`."""

    node: str
    device: int
    layers: tuple[int, int]


class DraftPlace(_Row):
    """Where the draft model runs."""

    node: str
    device: int


class InstancePlace(_Row):
    """Where an instance's shards run, as planned; `executor` "local": all in the instance actor's process."""

    stages: tuple[StagePlace, ...] = ()
    draft: DraftPlace | None = None
    executor: str = "local"

    @property
    def places(self) -> set[tuple[str, int]]:
        """Every (node, device) a shard of this instance runs on (as ShardLayout.places of its plan)."""
        return {(p.node, p.device) for p in self.stages + ((self.draft,) if self.draft else ())}


class InstanceRow(_Row):
    """One instance as the router reports it (cluster/registry.py, InstanceEntry.row)."""

    instance_id: str
    model: str
    node: str  # the node id of its instance actor
    healthy: bool
    error: str | None = None
    draining: bool = False
    accepting: bool = True  # healthy and not draining: dispatch may send it requests
    in_flight: int = 0
    stats: EngineStats | None = None  # None until the router's first poll of it
    age_s: float = 0.0
    place: InstancePlace = InstancePlace()
    removed_at: float | None = None  # set on instances removed for failing health
    incarnation: str = ""  # its actor's id: a replacement under the same instance id has another
    backend: str = ""  # the path its target model runs on and why, e.g. "native path (hand-written layers for qwen2)"
    role: str = "both"  # prefill, decode or both (cluster/disagg.py), as it registered

    @field_validator("stats", mode="before")
    @classmethod
    def _stats_from_wire(cls, v: object) -> object:
        return EngineStats.from_dict(v) if isinstance(v, dict) else v

    @field_serializer("stats")
    def _stats_to_wire(self, v: EngineStats | None) -> dict | None:
        """The stats travel flat, under the names they had before they were records (EngineStats.as_dict)."""
        return None if v is None else v.as_dict()


class RequestRow(_Row):
    """One row of the router's request table (cluster/registry.py, RequestEntry.row)."""

    request_id: str
    instance_id: str
    priority: int
    status: str  # running | finished | aborted | failed (cluster/request.py, RequestStatus)
    created_at: float
    finished_at: float | None = None


class DrainResult(_Row):
    """What a drain did: the instance takes no new requests (`draining`)."""

    instance_id: str
    draining: bool
    running: int = 0  # requests in flight on it when the drain began (after a migrating drain: still there)
    aborted: bool = False
    migrated: int = 0  # requests moved to other instances (a migrating drain)
    not_moved: list[str] = []  # and those that could not move, with why
