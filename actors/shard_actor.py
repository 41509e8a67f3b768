"""The shard as a Ray actor: ShardWorker plus where it runs; `ray.remote` is applied in `spawn`, not on the class."""

from __future__ import annotations

import math

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.p2p import free_address, use_node_interface
from actors.shard import ShardSpec, ShardWorker


KV_GROUP = "kv"  # the concurrency group of the calls that run beside the steps: opening and receiving migration links


class ShardActor(ShardWorker):
    """A ShardWorker that can say which node it runs on and offer a rendezvous address there. Its steps run one at
    a time; a migration's link calls (`kv_open`, `kv_receive`, `kv_close`, a link's address) run beside them, on
    threads of the "kv" concurrency group, so a transfer never holds up decoding."""

    def __init__(self, spec: ShardSpec, threads: int = 1) -> None:
        use_node_interface(ray.util.get_node_ip_address())  # gloo between nodes: over the node's own address
        super().__init__(spec, threads)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> str:
        """A free TCP address on this actor's node, for its instance's process group (rank 0 hosts it)."""
        return free_address(ray.util.get_node_ip_address())

    def ready(self) -> bool:
        return True

    @classmethod
    def spawn(cls, spec: ShardSpec, placement_group: PlacementGroup | None, bundle_index: int, *, num_cpus: float,
              num_gpus: float = 0.0, name: str | None = None) -> ActorHandle:
        """Start a shard actor in bundle `bundle_index` of `placement_group` (None: wherever Ray finds room, as in
        benchmarks on one machine); it loads its checkpoint at once."""
        strategy = None if placement_group is None else PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
        actor_cls = ray.remote(concurrency_groups={KV_GROUP: 4})(cls).options(
            num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=strategy, max_restarts=0, name=name)
        return actor_cls.remote(spec, threads=max(1, math.ceil(num_cpus)))  # torch threads: its CPU share, rounded up
