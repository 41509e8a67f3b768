"""Shards as Ray actors: each role's worker plus where it runs; `ray.remote` is applied in `spawn`, not on the class."""

from __future__ import annotations

import math

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.shards.expert import ExpertWorker
from actors.shards.group import GroupLeader, GroupMember
from actors.transport.p2p import free_address, use_node_interface
from actors.shards.stage import StageWorker


KV_GROUP = "kv"  # the concurrency group of the calls that run beside the steps: opening and receiving migration links


class ShardActor:
    """What every shard actor adds to its role's worker (the class it is mixed into, after it): which node it runs
    on, a rendezvous address there, readiness. Its steps run one at a time; a migration's link calls (`kv_open`,
    `kv_receive`, `kv_close`, a link's address) run beside them, on threads of the "kv" concurrency group, so a
    transfer never holds up decoding."""

    def __init__(self, spec, threads: int = 1) -> None:
        use_node_interface(ray.util.get_node_ip_address())  # gloo between nodes: over the node's own address
        super().__init__(spec, threads)  # type: ignore[call-arg]  # the role's worker, next in the MRO

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> str:
        """A free TCP address on this actor's node, for its group's process group (rank 0 hosts it)."""
        return free_address(ray.util.get_node_ip_address())

    def ready(self) -> bool:
        return True

    @classmethod
    def spawn(cls, spec, placement_group: PlacementGroup | None, bundle_index: int, *, num_cpus: float,
              num_gpus: float = 0.0, name: str | None = None) -> ActorHandle:
        """Start a shard actor of this role in bundle `bundle_index` of `placement_group` (None: wherever Ray finds
        room, as in benchmarks on one machine); it loads its checkpoint at once. `spec`: the role's spec."""
        strategy = None if placement_group is None else PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
        actor_cls = ray.remote(concurrency_groups={KV_GROUP: 4})(cls).options(
            num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=strategy, max_restarts=0, name=name)
        return actor_cls.remote(spec, threads=max(1, math.ceil(num_cpus)))  # torch threads: its CPU share, rounded up


class StageActor(ShardActor, StageWorker):
    """A pipeline stage, or a lone draft shard (spec: ShardSpec)."""


class LeaderActor(ShardActor, GroupLeader):
    """Rank 0 of an EasySpec draft group (spec: ShardSpec, with the draft's groups)."""


class MemberActor(ShardActor, GroupMember):
    """A rank > 0 of an EasySpec draft group (spec: MemberSpec)."""


class ExpertActor(ShardActor, ExpertWorker):
    """An expert-parallel rank (spec: ExpertSpec)."""
