"""The placement planner on plain data: speed-proportional splits under memory, draft placement, instances, errors."""

from __future__ import annotations

import doctest
import itertools
import random

import pytest

import placement.planner
from placement.inventory import Inventory, NodeSpec
from placement.model_size import ModelSize
from placement.planner import GB, InstancePlan, PlacementError, Plan, plan
from placement.split import Device, stage_time_ms


def fleet(*nodes: tuple[str, float, float] | tuple[str, float, float, int]) -> Inventory:
    """Nodes as (name, speed, memory_gb[, count])."""
    return Inventory(nodes=[
        NodeSpec(name=n[0], accelerator="test", speed=n[1], memory_gb=n[2], count=n[3] if len(n) > 3 else 1)
        for n in nodes
    ])


def model(layers: int, layer_gb: float = 1.0, kv_gb_per_layer: float = 0.0, head_gb: float = 0.001,
          name: str = "target") -> ModelSize:
    """A model with `layer_gb` of bf16 weights per layer, KV of `kv_gb_per_layer` per layer for kv_tokens=1000."""
    params = int(layer_gb * GB / 2)
    return ModelSize(
        name=name, num_layers=layers, params_per_layer=params, active_params_per_layer=params,
        embed_params=int(head_gb * GB / 2), head_params=int(head_gb * GB / 2),
        kv_bytes_per_token_per_layer=int(kv_gb_per_layer * GB / 1000), dtype_bytes=2,
    )


def layer_counts(instance: InstancePlan) -> dict[str, int]:
    return {stage.node: stage.num_layers for stage in instance.stages}


def check_plan(result: Plan, target: ModelSize, draft: ModelSize | None) -> None:
    """Invariants of every plan: contiguous cover of all layers, memory limits, devices used once per role."""
    seen_devices: set[tuple[str, int]] = set()
    for instance in result.instances:
        start = 0
        for stage in instance.stages:
            assert stage.layers[0] == start and stage.num_layers >= 1
            start = stage.layers[1]
        assert start == target.num_layers
        stage_devices = [(s.node, s.device) for s in instance.stages]
        assert len(set(stage_devices)) == len(stage_devices)
        capacity = {(s.node, s.device): s.capacity_bytes for s in instance.stages}
        if draft is not None:
            assert instance.draft is not None
            members = zip(instance.draft.nodes, instance.draft.devices, instance.draft.capacity_bytes)
            capacity.update({(node, device): cap for node, device, cap in members})
            bounds = instance.draft.layers
            assert bounds[0][0] == 0 and bounds[-1][1] == draft.num_layers
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        used = instance.device_memory()
        for key, nbytes in used.items():
            assert nbytes <= capacity[key], (key, nbytes, capacity[key])
        assert not (set(used) & seen_devices), "instances share a device"
        seen_devices |= set(used)


def test_the_worked_example_in_the_docstring_holds() -> None:
    failures, _ = doctest.testmod(placement.planner, raise_on_error=False, verbose=False)
    assert failures == 0


@pytest.mark.parametrize("layers", [32, 30, 7])
@pytest.mark.parametrize("num_nodes", [2, 3, 4])
def test_a_uniform_fleet_gets_an_even_split(layers: int, num_nodes: int) -> None:
    inventory = fleet(*[(f"n{i}", 1.0, 80.0) for i in range(num_nodes)])
    result = plan(inventory, model(layers), kv_tokens=1000, num_stages=num_nodes)
    counts = sorted(layer_counts(result.instances[0]).values())
    assert sum(counts) == layers and counts[-1] - counts[0] <= 1


def test_the_fewest_stages_that_fit_are_used() -> None:
    inventory = fleet(("a", 1.0, 80.0), ("b", 1.0, 80.0), ("c", 1.0, 80.0))
    assert len(plan(inventory, model(32), kv_tokens=1000).instances[0].stages) == 1  # 32 GB fits one device
    assert len(plan(inventory, model(100), kv_tokens=1000).instances[0].stages) == 2  # 100 GB needs two


@pytest.mark.parametrize("layers", [30, 31, 32, 40, 41, 80])
def test_a_two_to_one_speed_ratio_gives_about_a_two_to_one_split(layers: int) -> None:
    inventory = fleet(("slow", 1.0, 80.0), ("fast", 2.0, 80.0))
    result = plan(inventory, model(layers, layer_gb=0.5), kv_tokens=1000, num_stages=2)
    counts = layer_counts(result.instances[0])
    assert abs(counts["fast"] - 2 * layers / 3) <= 1
    assert counts["fast"] + counts["slow"] == layers


def test_a_memory_poor_fast_node_gets_fewer_layers_and_never_more_than_fits() -> None:
    inventory = fleet(("fast", 3.0, 10.0), ("slow", 1.0, 80.0))
    target = model(32, layer_gb=1.0, kv_gb_per_layer=0.25)
    result = plan(inventory, target, kv_tokens=1000, num_stages=2, memory_utilization=1.0)
    counts = layer_counts(result.instances[0])
    assert counts["fast"] < 32 * 3 / 4  # its speed share would be 24 layers
    assert counts["fast"] == 7  # as many as 10 GB holds at 1.25 GB a layer (and a tiny embedding or head)
    for stage in result.instances[0].stages:
        assert stage.memory_bytes <= stage.capacity_bytes
    check_plan(result, target, None)


def test_stage_times_follow_layers_over_speed() -> None:
    inventory = fleet(("fast", 2.0, 80.0), ("slow", 1.0, 80.0))
    target = model(30, layer_gb=0.5, head_gb=0.0)  # 0.5e9 FLOPs per layer per token: 0.25 ms on fast
    instance = plan(inventory, target, kv_tokens=0, num_stages=2).instances[0]
    for stage in instance.stages:
        speed = 2.0 if stage.node == "fast" else 1.0
        assert stage.expected_time_ms == pytest.approx(stage.num_layers * 0.5 / speed)
    assert instance.expected_step_ms == pytest.approx(sum(s.expected_time_ms for s in instance.stages))
    assert instance.bottleneck_ms == pytest.approx(5.0)  # 20 layers on fast, 10 on slow


def test_an_impossible_fit_names_the_model_and_the_shortfall() -> None:
    inventory = fleet(("a", 1.0, 16.0), ("b", 1.0, 16.0))
    with pytest.raises(PlacementError, match=r"target 'big'.*needs 40\.\d+ GB.*32\.00 GB usable.*short by 8\.\d+ GB"):
        plan(inventory, model(40, name="big"), kv_tokens=1000, memory_utilization=1.0)


def test_a_layer_larger_than_any_device_is_an_error() -> None:
    inventory = fleet(("a", 1.0, 16.0), ("b", 1.0, 16.0))
    with pytest.raises(PlacementError, match="one layer with its KV needs 20.00 GB"):
        plan(inventory, model(1, layer_gb=20.0), kv_tokens=1000, memory_utilization=1.0)


def test_bad_stage_counts_are_errors() -> None:
    inventory = fleet(("a", 1.0, 80.0))
    with pytest.raises(PlacementError, match="need at least 2 device"):
        plan(inventory, model(8), kv_tokens=0, num_stages=2)
    with pytest.raises(PlacementError, match="has 8 layers"):
        plan(fleet(*[(f"n{i}", 1.0, 80.0) for i in range(9)]), model(8), kv_tokens=0, num_stages=9)
    with pytest.raises(PlacementError, match="only 2 layers"):
        plan(fleet(*[(f"n{i}", 1.0, 80.0) for i in range(3)]), model(8), model(2), kv_tokens=0, draft_group_size=3)


def test_the_draft_lands_on_the_fastest_device_with_room() -> None:
    inventory = fleet(("mid", 2.0, 80.0), ("fast", 4.0, 80.0), ("slow", 1.0, 80.0))
    target, draft = model(32, layer_gb=2.0), model(4, layer_gb=1.0, name="draft")
    result = plan(inventory, target, draft, kv_tokens=1000, num_stages=2, memory_utilization=1.0)
    instance = result.instances[0]
    assert instance.draft is not None and instance.draft.nodes == ("fast",)
    check_plan(result, target, draft)


def test_the_draft_skips_a_fast_device_the_target_filled() -> None:
    inventory = fleet(("fast", 4.0, 20.0), ("mid", 2.0, 80.0), ("slow", 0.25, 80.0))
    target, draft = model(32, layer_gb=2.0), model(4, layer_gb=1.0, name="draft")
    result = plan(inventory, target, draft, kv_tokens=1000, num_stages=2, memory_utilization=1.0)
    instance = result.instances[0]
    assert layer_counts(instance)["fast"] == 9  # memory-capped: 9 * 2 GB + a tiny embedding or head
    assert instance.draft is not None and instance.draft.nodes == ("mid",)
    check_plan(result, target, draft)


def test_room_is_reserved_for_the_draft_when_the_target_leaves_none() -> None:
    inventory = fleet(("a", 1.0, 10.5), ("b", 1.0, 10.5))
    target, draft = model(16, layer_gb=1.0), model(3, layer_gb=1.0, name="draft")  # 16 + 3 GB of 21
    result = plan(inventory, target, draft, kv_tokens=0, num_stages=2, memory_utilization=1.0)
    check_plan(result, target, draft)
    instance = result.instances[0]
    assert instance.draft is not None
    counts = layer_counts(instance)
    assert counts[instance.draft.nodes[0]] == 7 and sum(counts.values()) == 16  # an even 8:8 would leave 2.5 GB free


def test_a_draft_that_cannot_fit_is_an_error_naming_it() -> None:
    inventory = fleet(("a", 1.0, 10.0), ("b", 1.0, 10.0))
    target, draft = model(16, layer_gb=1.0), model(5, layer_gb=1.0, name="tiny-draft")
    with pytest.raises(PlacementError, match=r"draft 'tiny-draft'.*needs 5\.\d+ GB on each of 1 device"):
        plan(inventory, target, draft, kv_tokens=0, num_stages=2, memory_utilization=1.0)


def test_an_easyspec_group_spans_the_fastest_devices() -> None:
    inventory = fleet(("n", 4.0, 80.0, 2), ("m", 2.0, 80.0, 2), ("s", 1.0, 80.0))
    target, draft = model(8, layer_gb=1.0), model(5, layer_gb=1.0, name="draft")
    result = plan(inventory, target, draft, kv_tokens=1000, draft_group_size=3)
    group = result.instances[0].draft
    assert group is not None
    assert sorted(group.nodes) == ["m", "n", "n"]  # both speed-4 devices, then a speed-2 one
    assert len(set(zip(group.nodes, group.devices))) == 3
    assert group.layers == ((0, 2), (2, 4), (4, 5))
    check_plan(result, target, draft)


def test_devices_of_a_multi_device_node_are_separate_stages() -> None:
    inventory = fleet(("box", 1.0, 24.0, 4))
    result = plan(inventory, model(60, layer_gb=1.0), kv_tokens=0, memory_utilization=1.0)
    stages = result.instances[0].stages
    assert len(stages) == 3 and {s.node for s in stages} == {"box"} and len({s.device for s in stages}) == 3


def test_instances_get_balanced_disjoint_shares_of_the_fleet() -> None:
    inventory = fleet(("a", 4.0, 80.0), ("b", 3.0, 80.0), ("c", 2.0, 80.0), ("d", 1.0, 80.0))
    target = model(40, layer_gb=1.5)
    result = plan(inventory, target, kv_tokens=1000, num_instances=2, num_stages=2)
    assert len(result.instances) == 2
    speeds = {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}
    shares = [sum(speeds[s.node] for s in inst.stages) for inst in result.instances]
    assert shares == [5.0, 5.0]  # snake deal: a+d and b+c
    check_plan(result, target, None)
    with pytest.raises(PlacementError, match="3 instance"):
        plan(inventory, target, kv_tokens=1000, num_instances=3, num_stages=2)


def test_random_fleets_give_valid_plans_or_clear_errors() -> None:
    rng = random.Random(1234)
    plans = errors = 0
    for trial in range(300):
        nodes = [
            (f"n{i}", rng.choice([0.5, 1.0, 1.5, 2.0, 3.0, 4.0]), rng.uniform(2.0, 40.0), rng.choice([1, 1, 2]))
            for i in range(rng.randint(1, 6))
        ]
        inventory = fleet(*nodes)
        target = model(rng.randint(1, 48), layer_gb=rng.uniform(0.1, 3.0), kv_gb_per_layer=rng.uniform(0, 0.5),
                       head_gb=rng.uniform(0.0, 2.0))
        draft = model(rng.randint(1, 8), layer_gb=rng.uniform(0.05, 1.0), name="draft") if rng.random() < 0.6 else None
        num_devices = sum(n[3] for n in nodes)
        num_stages = rng.choice([None, None, rng.randint(1, num_devices)])
        kwargs = dict(kv_tokens=1000, num_stages=num_stages, num_instances=rng.choice([1, 1, 2]),
                      draft_group_size=rng.choice([1, 1, 2]), memory_utilization=rng.choice([0.9, 1.0]))
        try:
            result = plan(inventory, target, draft, **kwargs)
        except PlacementError as error:
            assert str(error)
            errors += 1
            # whenever one device could hold both models whole, a single instance must be placed
            one_device = target.weight_bytes() + 1000 * target.num_layers * target.kv_bytes_per_token_per_layer
            if draft is not None:
                one_device += draft.weight_bytes() + 1000 * draft.num_layers * draft.kv_bytes_per_token_per_layer
            largest = max(n[2] for n in nodes) * GB * kwargs["memory_utilization"]
            if kwargs["num_instances"] == 1 and num_stages in (None, 1) and kwargs["draft_group_size"] == 1:
                assert one_device > largest, (trial, str(error))
            continue
        plans += 1
        check_plan(result, target, draft)
        if num_stages is not None:
            assert all(len(inst.stages) == num_stages for inst in result.instances)
    assert plans > 50 and errors > 20  # the sample exercises both outcomes


def brute_force_bottleneck(devices: list[Device], target: ModelSize, num_stages: int, kv_tokens: int) -> float | None:
    """The smallest slowest-stage time over every ordered choice of devices and every contiguous split."""
    best = None
    layers = target.num_layers
    for order in itertools.permutations(devices, num_stages):
        for cuts in itertools.combinations(range(1, layers), num_stages - 1):
            bounds = (0, *cuts, layers)
            slowest = 0.0
            for i, dev in enumerate(order):
                first, last, count = i == 0, i == num_stages - 1, bounds[i + 1] - bounds[i]
                if target.stage_bytes(count, kv_tokens, first=first, last=last) > dev.capacity_bytes:
                    break
                slowest = max(slowest, stage_time_ms(target, dev, count, last, 1))
            else:
                best = slowest if best is None else min(best, slowest)
    return best


def test_the_split_is_the_optimal_bottleneck_on_small_fleets() -> None:
    rng = random.Random(7)
    for _ in range(400):
        nodes = [(f"n{i}", rng.choice([0.5, 1.0, 2.0, 3.0]), rng.uniform(2.0, 20.0)) for i in range(rng.randint(1, 4))]
        target = model(rng.randint(1, 9), layer_gb=rng.uniform(0.5, 4.0), kv_gb_per_layer=rng.uniform(0, 0.5),
                       head_gb=rng.uniform(0.0, 3.0))
        num_stages = rng.randint(1, len(nodes))
        devices = [Device(n[0], 0, int(n[2] * GB), n[1], i) for i, n in enumerate(nodes)]
        best = brute_force_bottleneck(devices, target, num_stages, 1000)
        try:
            result = plan(fleet(*nodes), target, kv_tokens=1000, num_stages=num_stages, memory_utilization=1.0)
        except PlacementError:
            assert best is None
            continue
        assert best is not None and result.instances[0].bottleneck_ms == pytest.approx(best, rel=1e-9)
