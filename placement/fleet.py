"""The fleet planned once, and one instance planned again: each instance's id, resolved engine config, layout (stages and
draft on devices), executor."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import EngineConfig, FleetConfig
from cluster.disagg import Role
from cluster.instances import DraftPlace, InstancePlace, StagePlace
from placement.inventory import Inventory, NodeSpec
from placement.layout import ShardLayout
from placement.model_size import ModelSize
from placement.planner import PlacementError, plan


class InstanceSpec(BaseModel):
    """One instance as planned: actors/serving/server.py builds exactly this, and decides nothing itself.

    `engine.model` names files (catalog names are resolved where the fleet is planned); `executor` says where the
    stages run: "local" in the instance actor's own process (every shard on one device), "ray" in shard actors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_id: str
    engine: EngineConfig
    layout: ShardLayout
    executor: Literal["local", "ray"]
    num_cpus: float = Field(default=1.0, ge=0.0)  # the local instance's, or each shard actor's
    step_timeout_s: float = Field(default=120.0, gt=0.0)
    # where its goodput calibration is kept between starts (the model store's, set where the fleet is planned);
    # None: timed at every start, before it serves
    calibration_dir: str | None = None
    # prefill, decode or both (cluster/disagg.py): the instance reports it when it registers, so a router that restarts
    # and rebuilds its table from the instances gives each its role back (the autoscaler's included)
    role: Role = "both"

    @property
    def place(self) -> InstancePlace:
        """Where the instance's shards run, as operators see it (/admin/instances, `specfleet instances`)."""
        lay = self.layout
        draft = DraftPlace(node=lay.draft_node, device=lay.draft_device) if lay.draft_node is not None else None
        return InstancePlace(stages=tuple(StagePlace(node=s.node, device=s.device, layers=s.layers)
                                          for s in lay.stages), draft=draft, executor=self.executor)


def plan_fleet(engine: EngineConfig, fleet: FleetConfig, inventory: Inventory, target: ModelSize,
               draft: ModelSize | None, *, pins: Mapping[str, str] | None = None,
               gpu_nodes: Collection[str] = (), prefix: str = "inst") -> list[InstanceSpec]:
    """The whole fleet, planned once: `fleet.instances` instances of `fleet.pipeline_stages` stages each over
    `inventory`'s devices (placement/planner.py deals devices to instances, so no two share one), instance i
    named f"{prefix}-{i}". Re-planning after a change of nodes is a call with the new inventory.

    `engine` must already name files; `target` and `draft` are the models' sizes (`draft` None: no separate
    draft model). A self-speculative draft (`draft_layers`) shares the weights of stage 0 and sits on its device.
    `pins` maps a node to the Ray resource that pins work to it where that is not its `specfleet_node_<name>`
    (ShardLayout.pin); `gpu_nodes` are the nodes whose devices are real GPUs (the others are simulated on CPUs).
    An instance whose shards all share one device runs them in its own process ("local"), else in shard actors;
    each shard (or the local instance) asks Ray for its share of its device's GPU (`_with_gpus`).
    """
    p = plan(inventory, target, draft if engine.speculation.policy != "off" else None,
             kv_tokens=engine.cache.num_blocks * engine.cache.block_size, num_stages=fleet.pipeline_stages,
             num_instances=fleet.instances)
    specs = []
    for i, instance in enumerate(p.instances):
        layout = ShardLayout.from_plan(instance).model_copy(update={"pins": dict(pins or {})})
        first = layout.stages[0]
        if engine.model.draft_layers is not None and engine.speculation.policy != "off":
            layout = layout.model_copy(update={"draft_node": first.node, "draft_device": first.device})
        # expert-parallel ranks are actors even on one device: their all-to-all runs between processes
        executor = "local" if len(layout.places) == 1 and not engine.experts.enabled else "ray"
        layout = _with_gpus(layout, engine.model.device, gpu_nodes, f"{prefix}-{i}")
        specs.append(InstanceSpec(instance_id=f"{prefix}-{i}", engine=engine, layout=layout, executor=executor,
                                  num_cpus=fleet.instance_num_cpus))
    return specs


def plan_instance(engine: EngineConfig, fleet: FleetConfig, inventory: Inventory, target: ModelSize,
                  draft: ModelSize | None, index: int, *, taken: Collection[tuple[str, int]] = (),
                  pins: Mapping[str, str] | None = None, gpu_nodes: Collection[str] = (),
                  prefix: str = "inst") -> InstanceSpec:
    """Instance `index` of the fleet, planned again over `inventory` (the nodes alive now) where the other instances
    that run hold the devices `taken`: its own place in the whole fleet's plan (`plan_fleet`) when that place is
    free, else a plan of this instance alone (`plan_fleet` again) over the devices nobody holds. This is how an
    instance replaced after its node died lands on the nodes left, and how it comes back to a node that returns.
    PlacementError if it fits nowhere now (its caller waits for a node to join and asks again)."""
    name = f"{prefix}-{index}"
    taken = set(taken)
    try:
        mine = plan_fleet(engine, fleet, inventory, target, draft, pins=pins, gpu_nodes=gpu_nodes, prefix=prefix)[index]
        if mine.layout.places.isdisjoint(taken):
            return mine
    except (PlacementError, IndexError):  # the fleet no longer fits as a whole: place this one where there is room
        pass
    free, devices = _free(inventory, taken)
    if not free:
        raise PlacementError(f"{name}: every device of the live nodes is held by another instance")
    [alone] = plan_fleet(engine, fleet.model_copy(update={"instances": 1}), Inventory(nodes=free), target, draft,
                         pins=pins, gpu_nodes=gpu_nodes, prefix=prefix)
    lay = alone.layout  # device i of a node in `free` is the node's i-th free device
    stages = tuple(s.model_copy(update={"device": devices[s.node][s.device]}) for s in lay.stages)
    draft_device = devices[lay.draft_node][lay.draft_device] if lay.draft_node is not None else lay.draft_device
    layout = lay.model_copy(update={"stages": stages, "draft_device": draft_device})
    return alone.model_copy(update={"instance_id": name, "layout": layout})


def _free(inventory: Inventory, taken: set[tuple[str, int]]) -> tuple[list[NodeSpec], dict[str, list[int]]]:
    """The inventory's nodes with only the devices not `taken` (nodes with none left are dropped), and for each node
    the indices of its free devices."""
    nodes, devices = [], {}
    for node in inventory.nodes:
        free = [d for d in range(node.count) if (node.name, d) not in taken]
        if free:
            nodes.append(node.model_copy(update={"count": len(free)}))
            devices[node.name] = free
    return nodes, devices


def _with_gpus(layout: ShardLayout, device: str, gpu_nodes: Collection[str], name: str) -> ShardLayout:
    """`layout` with each shard's GPU request: none for device "cpu"; for "auto" and "cuda" its share of its
    device (1, or 1/n when the plan puts n shards of the instance on it) on nodes that have GPUs (`gpu_nodes`).
    "cuda" on a node without GPUs is a PlacementError."""
    if device == "cpu":
        return layout
    places = [(s.node, s.device) for s in layout.stages]
    if layout.draft_node is not None:
        places.append((layout.draft_node, layout.draft_device))
    missing = sorted({node for node, _ in places if node not in gpu_nodes})
    if device == "cuda" and missing:
        raise PlacementError(f"engine.model.device is cuda, but {name} is planned on nodes without GPUs: {missing}")
    share = {p: 1.0 / places.count(p) for p in places}
    gpus = [share[p] if p[0] in gpu_nodes else 0.0 for p in places]
    stages = tuple(s.model_copy(update={"gpus": g}) for s, g in zip(layout.stages, gpus))
    draft_gpus = gpus[-1] if layout.draft_node is not None else 0.0
    return layout.model_copy(update={"stages": stages, "draft_gpus": draft_gpus})
