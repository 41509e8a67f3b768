"""Realise a layout as a Ray placement group: the one module that creates and removes them, with deadlines.

Bundles are pinned to planned nodes by their custom resource (`specfleet_node_<name>`), so Ray's strategy
only breaks ties. Creation waits up to a timeout; if the bundles cannot be placed, the group is removed and
the error names each bundle's node and what that node has, so an operator sees what is missing.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from placement.inventory import NODE_RESOURCE


class RealizeError(RuntimeError):
    """The placement group could not be reserved in time; the message says which bundles and what nodes have."""


def reserve(bundles: list[dict[str, float]], *, name: str = "", timeout_s: float = 60.0) -> PlacementGroup:
    """Reserve `bundles` (see ShardLayout.bundles) and return the ready group; RealizeError after `timeout_s`."""
    pg = placement_group(bundles, strategy="PACK", name=name)
    try:
        ready = pg.wait(timeout_seconds=timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        raise RealizeError(f"placement group {name or '(unnamed)'} not placed within {timeout_s:g} s:\n"
                           + explain(bundles))
    return pg


def release(pg: PlacementGroup | None) -> None:
    """Remove a placement group (its actors are killed by Ray); a no-op for None."""
    if pg is not None:
        remove_placement_group(pg)


def explain(bundles: list[dict[str, float]]) -> str:
    """Each bundle's demand beside its node's total and available resources, as the cluster reports them now."""
    nodes = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for key in node["Resources"]:
                if key.startswith(NODE_RESOURCE.format(name="")):
                    nodes[key] = node
    free = ray.available_resources()
    lines = []
    for i, bundle in enumerate(bundles):
        pin = next((k for k in bundle if k.startswith(NODE_RESOURCE.format(name=""))), None)
        node = nodes.get(pin) if pin else None
        if pin and node is None:
            lines.append(f"  bundle {i} {bundle}: no live node has {pin}")
            continue
        have = {k: node["Resources"].get(k, 0.0) for k in bundle} if node else {}
        lines.append(f"  bundle {i} {bundle}: node {node['NodeName'] if node else '?'} has {have} in total "
                     f"(cluster-wide free now: { {k: free.get(k, 0.0) for k in bundle} })")
    return "\n".join(lines)
