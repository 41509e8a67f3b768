"""Heterogeneous placement plan: instances, the target's pipeline stages, where the draft runs, expected times."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from placement.inventory import Inventory
from placement.model_size import ModelSize
from placement.split import Device, Stage, split_layers, stage_time_ms

GB = 10**9  # bytes; memory_gb in the inventory is in GB of 10**9 bytes


class PlacementError(ValueError):
    """The models do not fit the inventory as asked; the message names the model and the memory needed vs available."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StagePlan(_Frozen):
    """Target layers [start, end) on device `device` of node `node`.

    `memory_bytes`: the stage's weights (plus the embedding if first, the final norm and LM head if last) and
    its KV reserve; `capacity_bytes`: the device's usable memory; `expected_time_ms`: one forward of
    `step_tokens` tokens through the stage, from FLOPs and the device's speed.
    """

    node: str
    device: int
    layers: tuple[int, int]
    memory_bytes: int
    capacity_bytes: int
    expected_time_ms: float

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB


class DraftPlan(_Frozen):
    """Where the draft runs: one device, or an EasySpec group of devices (member i on nodes[i], devices[i]).

    The draft's layers are split evenly and contiguously over the members (member i holds `layers[i]` and their
    KV; the first also the embedding, the last the final norm and LM head), of its device's usable
    `capacity_bytes`, which a target stage on the same device shares. `expected_time_ms` is one draft
    forward: the slowest member's share, i.e. the layer-parallel ideal that ignores EasySpec's all-gathers.
    """

    nodes: tuple[str, ...]
    devices: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]
    memory_bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    expected_time_ms: float


class InstancePlan(_Frozen):
    """One model replica: the target's stages in pipeline order and the draft's placement (None: no draft).

    `expected_step_ms`: one target forward through every stage in turn (a decode step visits them in order).
    """

    stages: tuple[StagePlan, ...]
    draft: DraftPlan | None
    expected_step_ms: float

    @property
    def bottleneck_ms(self) -> float:
        """The slowest stage: the pipeline's throughput limit when several micro-batches are in flight."""
        return max(stage.expected_time_ms for stage in self.stages)

    def speculative_step_ms(self, k: int) -> float:
        """k draft forwards and one target verification."""
        return k * (self.draft.expected_time_ms if self.draft else 0.0) + self.expected_step_ms

    def device_memory(self) -> dict[tuple[str, int], int]:
        """Bytes planned on each (node, device): target stage and draft member together."""
        used: dict[tuple[str, int], int] = {}
        for stage in self.stages:
            used[(stage.node, stage.device)] = used.get((stage.node, stage.device), 0) + stage.memory_bytes
        if self.draft:
            for node, device, nbytes in zip(self.draft.nodes, self.draft.devices, self.draft.memory_bytes):
                used[(node, device)] = used.get((node, device), 0) + nbytes
        return used


class Plan(_Frozen):
    instances: tuple[InstancePlan, ...]


def plan(
    inventory: Inventory,
    target: ModelSize,
    draft: ModelSize | None = None,
    *,
    kv_tokens: int,
    num_stages: int | None = None,
    num_instances: int = 1,
    draft_group_size: int = 1,
    step_tokens: int = 1,
    memory_utilization: float = 0.9,
) -> Plan:
    """Place `num_instances` replicas of `target` (pipeline stages) and `draft` on the devices of `inventory`.

    Each device (a node with `count` n has n of them) is one stage slot with `memory_utilization` of its
    memory usable. Devices are dealt to instances in snake order of speed (fastest to instance 0, 1, ...,
    then back), so instances get equal shares of fast and slow devices. Within an instance:
    1. Stages: `num_stages` of them, or the fewest (1, 2, ...) that fit. Layers go to stages in proportion
       to speed under each device's memory (weights, the KV of `kv_tokens` tokens per layer, the embedding
       on the first stage, the LM head on the last), minimising the slowest stage (placement/split.py).
    2. Draft: on the `draft_group_size` fastest devices with room left by the stages (sharing a stage's
       device is allowed and counted). If none has room, room is reserved for it on the fastest devices
       that could hold it, and the stages are split again around it.
    The draft reserves KV for the same `kv_tokens` as the target (it drafts for the same sequences).
    Times are FLOPs (2 per active parameter per token, `step_tokens` tokens) over speed (1.0 = 1e9 FLOPs/ms):
    a compute-bound estimate, used to balance stages; decode on GPUs is often memory-bound, so measured
    step times (actors/speculation/cost_model.py) are the ones to trust.

    Worked example: two nodes, "fast" (speed 2) and "slow" (speed 1), 40 GB each, all usable; a target of
    40 layers of 1 GB weights + 0.25 GB KV each, a 0.5 GB embedding and a 0.5 GB head. On one device it
    needs 40 * 1.25 + 1 = 51 GB > 40, so 2 stages. A layer is 1e9 FLOPs per token: 0.5 ms on fast, 1 ms
    on slow; the LM head is half a layer's FLOPs. Fast first with 27 layers takes 13.5 ms, slow last
    with 13 layers and the head 13 + 0.5 = 13.5 ms: the 2:1 speed ratio gives 27:13 (26.7:13.3 exactly).
    Memory is not binding: fast holds 27 * 1.25 + 0.5 = 34.25 GB of 40, slow 13 * 1.25 + 0.5 = 16.75 GB.

    >>> from placement.inventory import Inventory, NodeSpec
    >>> fleet = Inventory(nodes=[NodeSpec(name="fast", accelerator="x", memory_gb=40, speed=2.0),
    ...                          NodeSpec(name="slow", accelerator="x", memory_gb=40, speed=1.0)])
    >>> model = ModelSize(name="t", num_layers=40, params_per_layer=500_000_000,
    ...                   active_params_per_layer=500_000_000, embed_params=250_000_000,
    ...                   head_params=250_000_000, kv_bytes_per_token_per_layer=125_000, dtype_bytes=2)
    >>> p = plan(fleet, model, kv_tokens=2_000, memory_utilization=1.0)
    >>> [(s.node, s.layers, round(s.memory_gb, 2)) for s in p.instances[0].stages]
    [('fast', (0, 27), 34.25), ('slow', (27, 40), 16.75)]

    Raises PlacementError when it cannot fit, naming the model and the memory needed vs available.
    """
    if kv_tokens < 0 or step_tokens < 1 or num_instances < 1 or draft_group_size < 1:
        raise ValueError("kv_tokens must be >= 0 and step_tokens, num_instances, draft_group_size >= 1")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if draft is not None and draft_group_size > draft.num_layers:
        raise PlacementError(
            f"draft_group_size={draft_group_size}: draft {draft.name!r} has only {draft.num_layers} layers to share"
        )
    if num_stages is not None and not 1 <= num_stages <= target.num_layers:
        raise PlacementError(
            f"num_stages={num_stages}: target {target.name!r} has {target.num_layers} layers, so 1..{target.num_layers}"
        )
    devices = [
        Device(node.name, i, int(node.memory_gb * GB * memory_utilization), node.speed, order)
        for order, node in enumerate(inventory.nodes)
        for i in range(node.count)
    ]
    per_instance = max(num_stages or 1, draft_group_size if draft else 1)
    if len(devices) < num_instances * per_instance:
        raise PlacementError(
            f"{num_instances} instance(s) of target {target.name!r} need at least {per_instance} device(s) each, "
            f"but the inventory has {len(devices)}"
        )
    instances = [
        _plan_instance(n, share, target, draft, kv_tokens, num_stages, draft_group_size, step_tokens)
        for n, share in enumerate(_deal(devices, num_instances))
    ]
    return Plan(instances=tuple(instances))


def _deal(devices: Sequence[Device], num_instances: int) -> list[list[Device]]:
    """Devices, fastest first, dealt in snake order: 0, 1, ..., n-1, n-1, ..., 0, 0, 1, ..."""
    ranked = sorted(devices, key=lambda d: (-d.speed, -d.capacity_bytes, d.order, d.index))
    shares: list[list[Device]] = [[] for _ in range(num_instances)]
    for i, dev in enumerate(ranked):
        lap, pos = divmod(i, num_instances)
        shares[pos if lap % 2 == 0 else num_instances - 1 - pos].append(dev)
    return [sorted(share, key=lambda d: (d.order, d.index)) for share in shares]


def _plan_instance(
    number: int, devices: list[Device], target: ModelSize, draft: ModelSize | None, kv_tokens: int,
    num_stages: int | None, group_size: int, step_tokens: int,
) -> InstancePlan:
    counts = [num_stages] if num_stages is not None else range(1, min(len(devices), target.num_layers) + 1)
    target_fits = False
    for k in counts:
        stages = split_layers(devices, target, k, kv_tokens=kv_tokens, step_tokens=step_tokens)
        if stages is None:
            continue
        target_fits = True
        if draft is None:
            return _instance(stages, None, target, kv_tokens, step_tokens)
        used = {s.device: target.stage_bytes(s.num_layers, kv_tokens, first=s.first, last=s.last) for s in stages}
        group = _draft_group(devices, used, draft, group_size, kv_tokens)
        if group is not None:
            return _instance(stages, (draft, group), target, kv_tokens, step_tokens)
        for group in _draft_candidates(devices, draft, group_size, kv_tokens):
            reserved = {dev: need for dev, need in zip(group, _member_bytes(draft, group_size, kv_tokens))}
            stages = split_layers(devices, target, k, kv_tokens=kv_tokens, step_tokens=step_tokens, reserved=reserved)
            if stages is not None:
                return _instance(stages, (draft, group), target, kv_tokens, step_tokens)
    raise PlacementError(_explain(number, devices, target, draft, kv_tokens, num_stages, group_size, target_fits))


def _member_layers(draft: ModelSize, group_size: int) -> list[tuple[int, int]]:
    """Even contiguous split of the draft's layers over the group; earlier members take the remainder."""
    base, extra = divmod(draft.num_layers, group_size)
    bounds, start = [], 0
    for i in range(group_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _member_bytes(draft: ModelSize, group_size: int, kv_tokens: int) -> list[int]:
    return [
        draft.stage_bytes(end - start, kv_tokens, first=i == 0, last=i == group_size - 1)
        for i, (start, end) in enumerate(_member_layers(draft, group_size))
    ]


def _draft_group(
    devices: Sequence[Device], used: dict[Device, int], draft: ModelSize, group_size: int, kv_tokens: int
) -> list[Device] | None:
    """The `group_size` fastest devices whose free memory holds the largest member's share, or None."""
    need = max(_member_bytes(draft, group_size, kv_tokens))
    free = {d: d.capacity_bytes - used.get(d, 0) for d in devices}
    ranked = sorted(devices, key=lambda d: (-d.speed, -free[d], d.order, d.index))
    group = [d for d in ranked if free[d] >= need][:group_size]
    return group if len(group) == group_size else None


def _draft_candidates(
    devices: Sequence[Device], draft: ModelSize, group_size: int, kv_tokens: int
) -> list[list[Device]]:
    """Groups that could hold the draft on empty devices, fastest first: windows over the devices that fit it."""
    need = max(_member_bytes(draft, group_size, kv_tokens))
    able = [d for d in devices if d.capacity_bytes >= need]
    able.sort(key=lambda d: (-d.speed, -d.capacity_bytes, d.order, d.index))
    return [able[i:i + group_size] for i in range(len(able) - group_size + 1)]


def _instance(
    stages: list[Stage], draft: tuple[ModelSize, list[Device]] | None, target: ModelSize, kv_tokens: int,
    step_tokens: int,
) -> InstancePlan:
    stage_plans = tuple(
        StagePlan(
            node=s.device.node,
            device=s.device.index,
            layers=(s.start, s.end),
            memory_bytes=target.stage_bytes(s.num_layers, kv_tokens, first=s.first, last=s.last),
            capacity_bytes=s.device.capacity_bytes,
            expected_time_ms=stage_time_ms(target, s.device, s.num_layers, s.last, step_tokens),
        )
        for s in stages
    )
    draft_plan = None
    if draft is not None:
        model, group = draft
        bounds = _member_layers(model, len(group))
        last = len(group) - 1
        draft_plan = DraftPlan(
            nodes=tuple(d.node for d in group),
            devices=tuple(d.index for d in group),
            layers=tuple(bounds),
            memory_bytes=tuple(_member_bytes(model, len(group), kv_tokens)),
            capacity_bytes=tuple(d.capacity_bytes for d in group),
            expected_time_ms=max(
                stage_time_ms(model, d, end - start, i == last, step_tokens)
                for i, (d, (start, end)) in enumerate(zip(group, bounds))
            ),
        )
    return InstancePlan(
        stages=stage_plans, draft=draft_plan, expected_step_ms=sum(s.expected_time_ms for s in stage_plans)
    )


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB"


def _explain(
    number: int, devices: Sequence[Device], target: ModelSize, draft: ModelSize | None, kv_tokens: int,
    num_stages: int | None, group_size: int, target_fits: bool,
) -> str:
    """Why instance `number` cannot be placed: the model, what it needs, what the devices offer."""
    have = sum(d.capacity_bytes for d in devices)
    where = f"instance {number}'s {len(devices)} device(s) ({', '.join(d.label for d in devices)})"
    stages = f"{num_stages} stage(s)" if num_stages is not None else "any number of stages"
    weights = target.weight_bytes()
    kv = target.num_layers * kv_tokens * target.kv_bytes_per_token_per_layer
    need = weights + kv
    if not target_fits:
        short = f"; short by {_gb(need - have)}" if need > have else (
            f"; the largest device has {_gb(max(d.capacity_bytes for d in devices))}, "
            f"and one layer with its KV needs {_gb(target.stage_bytes(1, kv_tokens, first=False, last=False))}"
        )
        return (
            f"target {target.name!r} does not fit as {stages} on {where}: it needs {_gb(need)} "
            f"(weights {_gb(weights)} + KV for {kv_tokens} tokens {_gb(kv)}), "
            f"the devices have {_gb(have)} usable{short}"
        )
    assert draft is not None
    member = max(_member_bytes(draft, group_size, kv_tokens))
    return (
        f"draft {draft.name!r} does not fit beside target {target.name!r} on {where} with {stages}: "
        f"it needs {_gb(member)} on each of {group_size} device(s) (weights + KV for {kv_tokens} tokens), "
        f"and reserving that room first leaves too little for the target ({_gb(need)} needed, "
        f"{_gb(have)} usable in all)"
    )
