"""The fleet planned once (placement/fleet.py): each instance its own devices, layout, executor and place."""

from __future__ import annotations

import random

import pytest

from cluster.config import (CacheConfig, EngineConfig, ExpertParallelConfig, FleetConfig, ModelConfig,
                            SpeculationConfig)
from placement.fleet import plan_fleet, plan_instance
from placement.inventory import Inventory, NodeSpec
from placement.planner import PlacementError
from tests.unit.test_planner import model

FOUR_DEVICES = Inventory(nodes=[  # one node with two A100s, two nodes with one L4 each
    NodeSpec(name="a100", accelerator="a100-80g", count=2, memory_gb=80, speed=2.0),
    NodeSpec(name="l4-0", accelerator="l4-24g", count=1, memory_gb=24, speed=1.0),
    NodeSpec(name="l4-1", accelerator="l4-24g", count=1, memory_gb=24, speed=1.0),
])
CACHE = CacheConfig(block_size=16, num_blocks=64)


def engine(draft: str | None = "draft.gguf", draft_layers=None, policy: str = "fixed") -> EngineConfig:
    return EngineConfig(model=ModelConfig(target="target.gguf", draft=draft, draft_layers=draft_layers),
                        speculation=SpeculationConfig(policy=policy), cache=CACHE)


def test_two_instances_of_two_stages_take_four_distinct_devices() -> None:
    specs = plan_fleet(engine(), FleetConfig(instances=2, pipeline_stages=2), FOUR_DEVICES,
                       model(8), model(2, name="draft"))

    assert [s.instance_id for s in specs] == ["inst-0", "inst-1"]
    stages = [(st.node, st.device) for s in specs for st in s.layout.stages]
    assert len(set(stages)) == 4 == len(stages)
    for s in specs:
        assert [st.layers for st in s.layout.stages][0][0] == 0 and s.layout.stages[-1].layers[1] == 8
        assert (s.layout.draft_node, s.layout.draft_device) in s.layout.places  # the draft shares a stage's device
        assert s.executor == "ray"
        assert s.place.stages[0].node == s.layout.stages[0].node and s.place.draft is not None
    assert specs[0].layout.places.isdisjoint(specs[1].layout.places)


def test_a_self_draft_sits_on_stage_0s_device_and_one_device_runs_in_process() -> None:
    [spec] = plan_fleet(engine(draft=None, draft_layers=(0, 1)), FleetConfig(), FOUR_DEVICES, model(4), None)

    assert spec.executor == "local" and len(spec.layout.stages) == 1
    assert (spec.layout.draft_node, spec.layout.draft_device) == (spec.layout.stages[0].node, spec.layout.stages[0].device)
    assert spec.place.model_dump(mode="json")["stages"] == [{"node": "a100", "device": 0, "layers": [0, 4]}]


def test_without_speculation_no_draft_is_placed() -> None:
    [spec] = plan_fleet(engine(policy="off"), FleetConfig(), FOUR_DEVICES, model(4), model(2, name="draft"))
    assert spec.layout.draft_node is None and spec.place.draft is None


def test_instances_never_share_a_device() -> None:
    """Random fleets: every fleet planned gives each instance devices of its own; a draw with too little memory is
    refused (refusing is right, sharing a device would not be), and most draws do get planned."""
    planned = 0
    for seed in range(40):
        rng = random.Random(seed)
        nodes = [NodeSpec(name=f"n{i}", accelerator="x", count=rng.randint(1, 4), memory_gb=rng.choice([24, 40, 80]),
                          speed=rng.choice([1.0, 2.0, 3.0])) for i in range(rng.randint(1, 5))]
        inventory = Inventory(nodes=nodes)
        devices = sum(n.count for n in nodes)
        stages = rng.randint(1, 3)
        instances = rng.randint(1, max(1, devices // stages))
        try:
            specs = plan_fleet(engine(), FleetConfig(instances=instances, pipeline_stages=stages), inventory,
                               model(6, layer_gb=2.0), model(2, name="draft"))
        except PlacementError:
            continue
        planned += 1
        seen: set[tuple[str, int]] = set()
        for s in specs:
            assert not s.layout.places & seen
            seen |= s.layout.places
        assert sum(len(s.layout.places) for s in specs) <= devices
    assert planned >= 20, f"only {planned} of 40 random fleets were planned: the test checks too little"


def test_resolving_models_keeps_the_name_clients_use(tiny_models) -> None:
    from deploy.serve.fleet import resolved  # deploy's side: catalog names become files once, at build time

    cfg = engine(draft=None).model_copy(update={"model": ModelConfig(target="smollm2-135m-instruct")})
    out = resolved(cfg)
    assert out.model.served_name == "smollm2-135m-instruct" and out.model.target != "smollm2-135m-instruct"


def test_expert_parallel_ranks_take_one_planned_slot_each_as_actors() -> None:
    cfg = engine(policy="off").model_copy(update={"experts": ExpertParallelConfig(ranks=3)})
    [spec] = plan_fleet(cfg, FleetConfig(pipeline_stages=3), FOUR_DEVICES, model(8), None)
    assert spec.executor == "ray" and len(spec.layout.stages) == 3 == len(spec.layout.places)
    assert spec.engine.experts.ranks == 3


def test_an_instance_planned_again_keeps_its_place_while_it_is_free_and_lands_on_the_nodes_left() -> None:
    """Node loss and return (placement/fleet.py, plan_instance): the replacement of instance 1 takes its place in the
    fleet's plan while that place is free; when its node is gone it is planned alone over the devices nobody else
    holds; when nothing is free it waits (PlacementError); when the node returns it is used again."""
    shape = FleetConfig(instances=2)
    fleet = plan_fleet(engine(), shape, FOUR_DEVICES, model(4), model(2, name="draft"))
    holds = {i: s.layout.places for i, s in enumerate(fleet)}
    # every node alive, instance 0 where the plan put it: instance 1's replacement takes its planned place
    again = plan_instance(engine(), shape, FOUR_DEVICES, model(4), model(2, name="draft"), 1, taken=holds[0])
    assert again.instance_id == "inst-1" and again.layout.places == holds[1]
    # its node died: it lands on a device of the nodes left that instance 0 does not hold
    lost = next(iter(holds[1]))[0]
    left = Inventory(nodes=[n for n in FOUR_DEVICES.nodes if n.name != lost])
    moved = plan_instance(engine(), shape, left, model(4), model(2, name="draft"), 1, taken=holds[0])
    assert moved.instance_id == "inst-1" and moved.layout.places.isdisjoint(holds[0])
    assert {node for node, _ in moved.layout.places} <= {n.name for n in left.nodes}
    # only devices instance 0 holds are left: nowhere to go until a node returns
    only = Inventory(nodes=[n.model_copy(update={"count": 1}) for n in FOUR_DEVICES.nodes if (n.name, 0) in holds[0]])
    with pytest.raises(PlacementError, match="held by another instance"):
        plan_instance(engine(), shape, only, model(4), model(2, name="draft"), 1, taken=holds[0])
    # a device that is free on a node with another taken is addressed by its own index there
    a100_1 = plan_instance(engine(), FleetConfig(instances=3), FOUR_DEVICES, model(4), model(2, name="draft"), 2,
                           taken={("a100", 0), ("l4-0", 0), ("l4-1", 0)})
    assert a100_1.layout.places == {("a100", 1)}


def _pod(node_id: str, ip: str, kind: str = "l4-24g", group: str = "l4-24g") -> dict:
    """A KubeRay worker pod as ray.nodes() reports it: every inventory label but the name (k8s_render)."""
    labels = {"specfleet/accelerator": kind, "specfleet/count": "1", "specfleet/memory-gb": "24",
              "specfleet/speed": "1", "specfleet/group": group}
    return {"NodeID": node_id, "Alive": True, "Labels": labels, "NodeManagerAddress": ip, "Resources": {"CPU": 8.0}}


def test_kuberay_pods_are_named_by_slot_and_pinned_by_kind_so_a_replaced_pod_takes_its_place(monkeypatch) -> None:
    """Issue 24: unnamed pods were named and pinned by IP (`node:<ip>`), so a pod that replaced one (a new IP) never
    hosted an instance again. Now a group's pods are its slots, pinned by the kind's resource: after a pod is
    replaced the inventory, its names and its pins are what they were, and a planned place still exists."""
    import ray

    from deploy.serve.fleet import cluster_inventory

    monkeypatch.setattr(ray, "nodes", lambda: [_pod("b", "10.0.0.7"), _pod("a", "10.0.0.5")])
    inventory, pins, _ = cluster_inventory()
    monkeypatch.setattr(ray, "nodes", lambda: [_pod("b", "10.0.0.7"), _pod("c", "10.0.0.9"),
                                               {**_pod("a", "10.0.0.5"), "Alive": False}])
    replaced, pins_after, _ = cluster_inventory()

    assert [n.name for n in inventory.nodes] == ["l4-24g-0", "l4-24g-1"] == [n.name for n in replaced.nodes]
    assert pins == pins_after == {"l4-24g-0": "accelerator_l4-24g", "l4-24g-1": "accelerator_l4-24g"}
    assert not any("10.0.0" in p for p in pins.values())


def test_a_full_kuberay_group_gets_spare_pods_to_plan_a_scale_out_on_up_to_its_max_and_named_nodes_do_not() -> None:
    """Scale-out on KubeRay (docs/autoscaling.md): every device of the live pods is held, so the plan over them fails;
    over one more pod of the group (`spare_pods`) the instance lands on that pod's slot, pinned by its kind's resource
    and asking for the group's resources: its actor waits until Ray's autoscaler adds the pod. Nodes of `specfleet
    cluster up` (named, pinned each) are not a group that grows: no spare, the step fails as before."""
    from deploy.serve.fleet import nodes_inventory

    pods = [_pod("a", "10.0.0.5"), {**_pod("b", "10.0.0.7"), "Resources": {"CPU": 8.0, "GPU": 1.0}}]
    live, _, _ = nodes_inventory(pods)
    spare, pins, gpu_nodes = nodes_inventory(pods, spare_pods=True)
    assert [n.name for n in live.nodes] == ["l4-24g-0", "l4-24g-1"]
    assert [n.name for n in spare.nodes] == ["l4-24g-0", "l4-24g-1", "l4-24g-2"]
    assert spare.nodes[2].model_copy(update={"name": "x"}) == live.nodes[1].model_copy(update={"name": "x"})
    assert pins["l4-24g-2"] == "accelerator_l4-24g" and "l4-24g-2" in gpu_nodes  # as the group's last pod
    shape = FleetConfig(instances=1)
    held = {("l4-24g-0", 0), ("l4-24g-1", 0)}
    with pytest.raises(PlacementError):
        plan_instance(engine(), shape, live, model(2), None, 2, taken=held, pins=pins)
    grown = plan_instance(engine(), shape, spare, model(2), None, 2, taken=held, pins=pins)
    assert grown.layout.places == {("l4-24g-2", 0)} and grown.layout.pin("l4-24g-2") == "accelerator_l4-24g"

    # a group's pods say its maxReplicas (k8s_render): as many spares as it may still grow by, none at its max
    capped = [{**p, "Labels": {**p["Labels"], "specfleet/max-pods": "4"}} for p in pods]
    room, pins, _ = nodes_inventory(capped, spare_pods=True)
    assert [n.name for n in room.nodes] == ["l4-24g-0", "l4-24g-1", "l4-24g-2", "l4-24g-3"]
    first = plan_instance(engine(), shape, room, model(2), None, 2, taken=held, pins=pins)
    second = plan_instance(engine(), shape, room, model(2), None, 3, taken=held | first.layout.places, pins=pins)
    assert first.layout.places | second.layout.places == {("l4-24g-2", 0), ("l4-24g-3", 0)}  # a step of two
    at_max = [{**p, "Labels": {**p["Labels"], "specfleet/max-pods": "2"}} for p in pods]
    none, pins, _ = nodes_inventory(at_max, spare_pods=True)
    assert [n.name for n in none.nodes] == ["l4-24g-0", "l4-24g-1"]
    with pytest.raises(PlacementError):  # at once: no pod will come for it
        plan_instance(engine(), shape, none, model(2), None, 2, taken=held, pins=pins)

    named = {"NodeID": "c", "Alive": True, "Resources": {"CPU": 8.0},
             "Labels": {**_pod("c", "")["Labels"], "specfleet/node": "l4-0"}}
    assert [n.name for n in nodes_inventory([named], spare_pods=True)[0].nodes] == ["l4-0"]
