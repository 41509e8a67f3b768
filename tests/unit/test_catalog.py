"""The device catalog fills nodes' missing figures; measured speeds override declared ones."""

from __future__ import annotations

import pytest

from placement.benchmark import measure_speed
from placement.catalog import CATALOG, CatalogError, lookup
from placement.inventory import complete_node, override_speeds
from placement.inventory import Inventory, NodeSpec


def test_the_catalog_knows_the_common_kinds() -> None:
    for kind in ("a100-80g", "a100-40g", "h100-80g", "l4-24g", "a10g-24g", "t4-16g", "cpu"):
        entry = lookup(kind)
        assert entry.memory_gb > 0 and entry.speed > 0
    assert lookup("H100-80G") == CATALOG["h100-80g"]
    assert lookup("h100-80g").speed > lookup("a100-80g").speed > lookup("l4-24g").speed > lookup("cpu").speed


def test_missing_figures_come_from_the_catalog_and_declared_ones_win() -> None:
    node = complete_node({"name": "n0", "accelerator": "l4-24g", "count": 2})
    assert (node.memory_gb, node.speed, node.count) == (24.0, 121.0, 2)
    node = complete_node({"name": "n1", "accelerator": "cpu", "memory_gb": 64.0, "speed": None})
    assert (node.memory_gb, node.speed) == (64.0, CATALOG["cpu"].speed)
    declared = NodeSpec(name="n2", accelerator="mystery", memory_gb=8.0, speed=3.0)
    assert complete_node(declared) == declared


def test_an_unknown_accelerator_without_figures_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"unknown accelerator 'tpu-v9'.*a100-40g"):
        complete_node({"name": "n0", "accelerator": "tpu-v9"})


def test_measured_speeds_override_the_named_nodes_only() -> None:
    inventory = Inventory(nodes=[
        NodeSpec(name="a", accelerator="cpu", memory_gb=8.0, speed=1.0),
        NodeSpec(name="b", accelerator="cpu", memory_gb=8.0, speed=1.0),
    ])
    updated = override_speeds(inventory, {"b": 2.5})
    assert [n.speed for n in updated.nodes] == [1.0, 2.5]
    assert [n.speed for n in inventory.nodes] == [1.0, 1.0]
    with pytest.raises(CatalogError, match=r"unknown nodes \['z'\]"):
        override_speeds(inventory, {"z": 1.0})
    with pytest.raises(CatalogError, match="positive"):
        override_speeds(inventory, {"a": 0.0})


def test_the_micro_benchmark_returns_a_positive_speed() -> None:
    assert measure_speed("cpu", size=64, repeats=3, warmup=1) > 0
