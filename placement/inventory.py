"""The node inventory: each node's accelerator kind, device count, memory per device and relative speed."""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.config_file import ConfigError, describe, read_yaml
from placement.catalog import CatalogError, fill_figures

# Node names and accelerator kinds become Ray label values and parts of Ray resource names, so they follow
# Ray's (Kubernetes') label value syntax: 1-63 alphanumerics, '-', '_' or '.', alphanumeric at both ends.
NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"

# Ray custom resources and labels a node of the inventory carries (ray_resources, ray_labels): the contract
# between the local cluster (deploy/infra/local_cluster.py), KubeRay worker groups, and placement groups that pin
# work to a node (NODE_RESOURCE) or to a device kind (ACCELERATOR_RESOURCE).
NODE_RESOURCE = "specfleet_node_{name}"
ACCELERATOR_RESOURCE = "accelerator_{kind}"
ACCELERATOR_MEMORY_RESOURCE = "specfleet_accelerator_memory_gb"
NODE_RESOURCE_UNITS = 1000  # a task or bundle pins itself to a node by asking for 1 of these
LABEL_PREFIX = "specfleet/"
MAX_PODS_LABEL = f"{LABEL_PREFIX}max-pods"  # a KubeRay worker group's maxReplicas, on each of its pods


def _label_value(text: str) -> str:
    if not re.fullmatch(NAME_PATTERN, text):
        raise ValueError(
            f"{text!r} must be 1-63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
        )
    return text


Name = Annotated[str, AfterValidator(_label_value)]


class NodeSpec(BaseModel):
    """One node: `count` devices of kind `accelerator`, each of `memory_gb` (10**9 bytes) and relative `speed`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Name
    accelerator: Name
    count: int = Field(default=1, ge=1)
    memory_gb: float = Field(gt=0)
    speed: float = Field(gt=0)


class Inventory(BaseModel):
    """The nodes of a fleet, in order; names are unique."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[NodeSpec] = Field(min_length=1)

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, nodes: list[NodeSpec]) -> list[NodeSpec]:
        names = [node.name for node in nodes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"node names must be unique, repeated: {duplicates}")
        return nodes

    def first(self, n: int) -> Inventory:
        """The first `n` nodes; ConfigError if there are fewer or `n` < 1."""
        if not 1 <= n <= len(self.nodes):
            raise ConfigError(f"asked for {n} nodes, but the inventory has {len(self.nodes)} (1..{len(self.nodes)})")
        return Inventory(nodes=self.nodes[:n])


def ray_resources(node: NodeSpec) -> dict[str, float]:
    """Custom Ray resources of `node`: a pin by name, its devices by kind, and its total accelerator memory."""
    return {
        NODE_RESOURCE.format(name=node.name): NODE_RESOURCE_UNITS,
        ACCELERATOR_RESOURCE.format(kind=node.accelerator): node.count,
        ACCELERATOR_MEMORY_RESOURCE: node.count * node.memory_gb,
    }


def ray_labels(node: NodeSpec) -> dict[str, str]:
    """Ray node labels of `node` (e.g. `specfleet/node: a100`); numbers as plain decimals ('80', '0.5')."""
    return {
        f"{LABEL_PREFIX}node": node.name,
        f"{LABEL_PREFIX}accelerator": node.accelerator,
        f"{LABEL_PREFIX}count": str(node.count),
        f"{LABEL_PREFIX}memory-gb": _decimal(node.memory_gb),
        f"{LABEL_PREFIX}speed": _decimal(node.speed),
    }


def _decimal(x: float) -> str:
    text = f"{x:.6f}".rstrip("0").rstrip(".")
    return text if text != "0" else f"{x:.6e}".replace("+", "")  # a tiny positive figure stays nonzero


def load_inventory(path: str | Path) -> Inventory:
    """Read an inventory YAML (`nodes:` a list of NodeSpec mappings); errors name the file and the key.

    A node's missing `memory_gb` or `speed` is filled from the device catalog (placement/catalog.py).
    """
    raw = read_yaml(path, "inventory")
    return parse_inventory(raw, source=str(path))


def parse_inventory(raw: object, source: str = "<inventory>") -> Inventory:
    """Validate an already-parsed mapping `{"nodes": [...]}`; `source` names where it came from in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'nodes' list, got {type(raw).__name__}")
    nodes = raw.get("nodes")
    if isinstance(nodes, list):
        filled: list[object] = []
        for i, entry in enumerate(nodes):
            if isinstance(entry, dict):
                try:
                    entry = complete_node(entry)
                except CatalogError as e:
                    raise ConfigError(f"{source}: nodes.{i}: {e}") from None
                except ValidationError as e:
                    raise ConfigError(describe(e, source, prefix=f"nodes.{i}.")) from None
            filled.append(entry)
        raw = {**raw, "nodes": filled}
    try:
        return Inventory.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(describe(e, source)) from None


def inventory_from_labels(nodes: list[dict[str, str]]) -> Inventory:
    """The inventory a running cluster declares: each node's `ray_labels` (nodes without them are skipped)."""
    specs = []
    for labels in nodes:
        if f"{LABEL_PREFIX}node" not in labels:
            continue
        specs.append(NodeSpec(name=labels[f"{LABEL_PREFIX}node"], accelerator=labels[f"{LABEL_PREFIX}accelerator"],
                              count=int(labels[f"{LABEL_PREFIX}count"]),
                              memory_gb=float(labels[f"{LABEL_PREFIX}memory-gb"]),
                              speed=float(labels[f"{LABEL_PREFIX}speed"])))
    if not specs:
        raise ConfigError("no node of this cluster carries specfleet labels (start it with `specfleet cluster up`)")
    return Inventory(nodes=sorted(specs, key=lambda s: s.name))


def complete_node(entry: Mapping[str, Any] | NodeSpec) -> NodeSpec:
    """A NodeSpec from a raw inventory entry, its missing memory_gb and speed filled from the device catalog
    (placement/catalog.py `fill_figures`)."""
    return NodeSpec.model_validate(fill_figures(entry.model_dump() if isinstance(entry, NodeSpec) else entry))


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
