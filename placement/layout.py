"""Where one instance's actors run: target stages (node, device, layer range), the draft's place, their Ray bundles.

A ShardLayout comes from the planner (`ShardLayout.from_plan`) or is written out by hand (tests, operators).
`bundles` turns it into Ray placement-group bundles pinned to nodes by the custom resource each node of the
inventory carries (placement/inventory.py, NODE_RESOURCE); placement/realize.py reserves them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.inventory import NODE_RESOURCE
from placement.planner import InstancePlan, PlacementError


PIN_UNITS = 0.001  # of a node's pin resource per bundle: a node's own `node:<ip>` resource has only 1 unit


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StageSlot(_Frozen):
    """Target layers [start, end) on device `device` (its index among the node's accelerators) of node `node`."""

    node: str
    device: int = Field(default=0, ge=0)
    layers: tuple[int, int]
    gpus: float = Field(default=0.0, ge=0.0, le=1.0)  # of its device the shard asks Ray for (0: it runs on a CPU)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(range(*self.layers))


class ShardLayout(_Frozen):
    """An instance's target stages in pipeline order (contiguous layers from 0), and the draft's node (None: none)
    and device there."""

    stages: tuple[StageSlot, ...]
    draft_node: str | None = None
    draft_device: int = Field(default=0, ge=0)
    draft_gpus: float = Field(default=0.0, ge=0.0, le=1.0)
    # node -> the Ray resource that pins work to it, where it is not NODE_RESOURCE (e.g. "node:<ip>" for a pod)
    pins: dict[str, str] = {}

    def pin(self, node: str) -> str:
        """The Ray custom resource of which 1 unit (or a sliver) keeps a bundle or actor on `node`."""
        return self.pins.get(node, NODE_RESOURCE.format(name=node))

    @model_validator(mode="after")
    def _contiguous(self) -> "ShardLayout":
        if not self.stages:
            raise ValueError("a layout needs at least one stage")
        start = 0
        for i, s in enumerate(self.stages):
            if s.layers[0] != start or s.layers[1] <= s.layers[0]:
                raise ValueError(f"stage {i} holds layers {s.layers}; expected [{start}, n) with n > {start}")
            start = s.layers[1]
        return self

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @classmethod
    def from_plan(cls, plan: InstancePlan) -> "ShardLayout":
        """The layout of a planned instance; an EasySpec draft group (more than one member) is not supported yet."""
        if plan.draft is not None and len(plan.draft.nodes) > 1:
            raise PlacementError(f"a draft group of {len(plan.draft.nodes)} members needs EasySpec actors, "
                                 "which this layout does not place yet")
        return cls(stages=tuple(StageSlot(node=s.node, device=s.device, layers=s.layers) for s in plan.stages),
                   draft_node=plan.draft.nodes[0] if plan.draft else None,
                   draft_device=plan.draft.devices[0] if plan.draft else 0)

    @property
    def places(self) -> set[tuple[str, int]]:
        """Every (node, device) a shard of this layout runs on."""
        draft = {(self.draft_node, self.draft_device)} if self.draft_node is not None else set()
        return {(s.node, s.device) for s in self.stages} | draft

    def check(self, num_layers: int) -> None:
        """PlacementError unless the stages cover exactly the target's `num_layers` layers."""
        if self.num_layers != num_layers:
            raise PlacementError(f"the layout's stages cover layers [0, {self.num_layers}); "
                                 f"the target has {num_layers}")

    def bundles(self, num_cpus: float) -> list[dict[str, float]]:
        """Bundles in order: one per stage, then the draft's (if any).

        Each asks for `num_cpus` CPUs, its slot's GPUs (if any) and a sliver of its node's pin resource.

        >>> layout = ShardLayout(stages=(StageSlot(node="a100", layers=(0, 3), gpus=1.0),
        ...                              StageSlot(node="l4-0", layers=(3, 4))), draft_node="l4-1")
        >>> layout.bundles(num_cpus=0.5)  # doctest: +NORMALIZE_WHITESPACE
        [{'CPU': 0.5, 'GPU': 1.0, 'specfleet_node_a100': 0.001}, {'CPU': 0.5, 'specfleet_node_l4-0': 0.001},
         {'CPU': 0.5, 'specfleet_node_l4-1': 0.001}]
        """
        def bundle(node: str, gpus: float) -> dict[str, float]:
            return {"CPU": num_cpus, **({"GPU": gpus} if gpus else {}), self.pin(node): PIN_UNITS}

        slots = [(s.node, s.gpus) for s in self.stages]
        if self.draft_node is not None:
            slots.append((self.draft_node, self.draft_gpus))
        return [bundle(node, gpus) for node, gpus in slots]

    @property
    def draft_bundle(self) -> int | None:
        return len(self.stages) if self.draft_node is not None else None
