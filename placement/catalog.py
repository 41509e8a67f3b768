"""Device catalog: known accelerator kinds -> memory and relative speed, and filling or overriding a node's figures."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from placement.inventory import Inventory, NodeSpec


class DeviceKind(NamedTuple):
    """One accelerator kind: memory per device (GB, 10**9 bytes) and relative speed.

    Speed is a peak dense fp16/bf16 tensor throughput in TFLOPS, used only as a ratio between devices;
    the planner turns it into milliseconds with `ModelSize` FLOPs, so on real hardware it is an optimistic
    absolute figure but a fair relative one. `measure_speed()` (placement/benchmark.py) gives a measured
    number in the same unit (achieved TFLOPS of a matmul) to override it with.
    """

    memory_gb: float
    speed: float


# Memory: the marketed size, in GB of 10**9 bytes, which is at most the size the device reports
# (an "80 GB" A100 reports 81920 MiB, about 85.9e9 bytes), so plans built on it err on the safe side.
# Speed: vendor-datasheet dense (non-sparse) fp16/bf16 tensor TFLOPS, rounded; the a10g and cpu figures are
# rough estimates with no datasheet behind them. Replace any of them with measure_speed() for real plans.
CATALOG: dict[str, DeviceKind] = {
    "h100-80g": DeviceKind(memory_gb=80.0, speed=989.0),  # SXM
    "a100-80g": DeviceKind(memory_gb=80.0, speed=312.0),
    "a100-40g": DeviceKind(memory_gb=40.0, speed=312.0),
    "l4-24g": DeviceKind(memory_gb=24.0, speed=121.0),
    "a10g-24g": DeviceKind(memory_gb=24.0, speed=70.0),  # estimate
    "t4-16g": DeviceKind(memory_gb=16.0, speed=65.0),
    "cpu": DeviceKind(memory_gb=16.0, speed=1.0),  # estimate; host memory varies, so declare it per node
}


class CatalogError(ValueError):
    """A node names an unknown accelerator and leaves a figure to the catalog, or a measurement names no node."""


def lookup(accelerator: str) -> DeviceKind:
    """The catalog entry of `accelerator` (case-insensitive); CatalogError naming the known kinds if absent."""
    kind = CATALOG.get(accelerator.lower())
    if kind is None:
        raise CatalogError(
            f"unknown accelerator {accelerator!r}: declare memory_gb and speed for it, "
            f"or use one of {sorted(CATALOG)}"
        )
    return kind


def complete_node(entry: Mapping[str, Any] | NodeSpec) -> NodeSpec:
    """A NodeSpec from a raw inventory entry (e.g. a YAML mapping), its missing memory_gb and speed filled in.

    A key that is absent or None is taken from the catalog entry of the node's accelerator; declared
    figures always win. Example: `{"name": "n0", "accelerator": "l4-24g", "count": 2}` becomes a node
    of 2 devices of 24 GB and speed 121.
    """
    raw = dict(entry.model_dump() if isinstance(entry, NodeSpec) else entry)
    missing = [key for key in ("memory_gb", "speed") if raw.get(key) is None]
    if missing:
        if "accelerator" not in raw:
            raise CatalogError(f"node {raw.get('name', '?')!r} declares no accelerator, so {missing} cannot be filled")
        kind = lookup(str(raw["accelerator"]))
        for key in missing:
            raw[key] = getattr(kind, key)
    return NodeSpec.model_validate(raw)


def override_speeds(inventory: Inventory, measured: Mapping[str, float]) -> Inventory:
    """A copy of `inventory` with the speeds of the nodes named in `measured` replaced by the measured ones.

    Nodes not named keep their speed, so measure every node (or none): a measured figure (achieved
    TFLOPS) and a catalog peak are not the same kind of number. A name that is not a node, or a
    speed that is not positive, is a CatalogError.
    """
    names = {node.name for node in inventory.nodes}
    unknown = sorted(set(measured) - names)
    if unknown:
        raise CatalogError(f"measured speeds for unknown nodes {unknown}; nodes are {sorted(names)}")
    bad = {name: speed for name, speed in measured.items() if not speed > 0}
    if bad:
        raise CatalogError(f"measured speeds must be positive, got {bad}")
    raw = inventory.model_dump()
    for node in raw["nodes"]:
        if node["name"] in measured:
            node["speed"] = float(measured[node["name"]])
    return Inventory.model_validate(raw)
