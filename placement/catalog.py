"""Device catalog: known accelerator kinds -> memory and relative speed (a pure table; placement/inventory.py
fills and overrides nodes' figures from it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple



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


def fill_figures(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a raw inventory entry (e.g. a YAML mapping) with its missing `memory_gb` and `speed` taken from
    the catalog entry of its accelerator; declared figures always win. Example: `{"name": "n0", "accelerator":
    "l4-24g", "count": 2}` gains `memory_gb: 24.0, speed: 121.0`."""
    raw = dict(entry)
    missing = [key for key in ("memory_gb", "speed") if raw.get(key) is None]
    if missing:
        if "accelerator" not in raw:
            raise CatalogError(f"node {raw.get('name', '?')!r} declares no accelerator, so {missing} cannot be filled")
        kind = lookup(str(raw["accelerator"]))
        for key in missing:
            raw[key] = getattr(kind, key)
    return raw
