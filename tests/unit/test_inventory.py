"""The node inventory schema: the shipped fleet loads, catalog gaps are filled, and every mistake is named clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest

import deploy
from cluster.config import ConfigError
from placement.catalog import CATALOG
from placement.inventory import (
    NAME_PATTERN,
    Inventory,
    NodeSpec,
    load_inventory,
    parse_inventory,
    ray_labels,
    ray_resources,
)

FLEET = Path(deploy.__file__).parent / "configs" / "fleet.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_shipped_fleet_loads() -> None:
    inventory = load_inventory(FLEET)
    assert [(n.name, n.accelerator, n.count) for n in inventory.nodes] == [
        ("a100", "a100-80g", 2), ("l4-0", "l4-24g", 1), ("l4-1", "l4-24g", 1)]
    a100, l4 = inventory.nodes[0], inventory.nodes[1]
    assert (a100.memory_gb, a100.speed) == (80.0, 2.0) and (l4.memory_gb, l4.speed) == (24.0, 1.0)


def test_nodes_are_frozen_and_count_defaults_to_one() -> None:
    node = NodeSpec(name="n0", accelerator="cpu", memory_gb=16, speed=1)
    assert node.count == 1
    with pytest.raises(pydantic.ValidationError):
        node.count = 2  # type: ignore[misc]


def test_missing_figures_come_from_the_catalog_and_declared_ones_win() -> None:
    inventory = parse_inventory({"nodes": [{"name": "a", "accelerator": "l4-24g", "count": 2},
                                           {"name": "b", "accelerator": "t4-16g", "speed": 3.5}]})
    a, b = inventory.nodes
    assert (a.count, a.memory_gb, a.speed) == (2, CATALOG["l4-24g"].memory_gb, CATALOG["l4-24g"].speed)
    assert (b.memory_gb, b.speed) == (CATALOG["t4-16g"].memory_gb, 3.5)


def test_first_n_nodes() -> None:
    inventory = load_inventory(FLEET)
    assert [n.name for n in inventory.first(2).nodes] == ["a100", "l4-0"]
    for n in (0, 4):
        with pytest.raises(ConfigError, match="inventory has 3"):
            inventory.first(n)


@pytest.mark.parametrize(
    "text, message",
    [
        ("nodes: [\n", "not valid YAML"),
        ("- a\n- b\n", "expected a mapping with a 'nodes' list, got list"),
        ("nodes: []\n", "nodes: List should have at least 1 item"),
        ("nodes: 3\n", "nodes: Input should be a valid list"),
        ("nodes:\n  - {name: a, accelerator: cpu, memory_gb: 8, speed: 1, gpus: 2}\n", "nodes.0.gpus: unknown key"),
        ("nodes:\n  - {name: a, accelerator: cpu, memory_gb: 8, speed: 1}\nextra: 1\n", "extra: unknown key"),
        ("nodes:\n  - {name: a, accelerator: cpu}\n  - {name: a, accelerator: cpu}\n", "unique, repeated: ['a']"),
        ("nodes:\n  - {name: a/b, accelerator: cpu}\n", "nodes.0.name: Value error, 'a/b' must be 1-63"),
        ("nodes:\n  - {name: a, accelerator: cpu, count: 0}\n", "nodes.0.count: Input should be greater than or"),
        ("nodes:\n  - {name: a, accelerator: cpu, memory_gb: -1}\n", "nodes.0.memory_gb: Input should be greater"),
        ("nodes:\n  - {name: a, accelerator: mystery-9000}\n", "nodes.0: unknown accelerator 'mystery-9000'"),
        ("nodes:\n  - {accelerator: cpu}\n", "nodes.0.name: Field required"),
    ],
)
def test_bad_inventories_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_inventory(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such inventory file"):
        load_inventory(tmp_path / "absent.yaml")


def test_ray_labels_and_resources_follow_the_naming_contract() -> None:
    node = NodeSpec(name="l4-0", accelerator="l4-24g", count=2, memory_gb=24, speed=0.5)
    assert ray_resources(node) == {"specfleet_node_l4-0": 1000, "accelerator_l4-24g": 2,
                                   "specfleet_accelerator_memory_gb": 48.0}
    assert ray_labels(node) == {"specfleet/node": "l4-0", "specfleet/accelerator": "l4-24g", "specfleet/count": "2",
                                "specfleet/memory-gb": "24", "specfleet/speed": "0.5"}
    tiny = ray_labels(NodeSpec(name="t", accelerator="cpu", memory_gb=1e-9, speed=123456.75))
    assert tiny["specfleet/memory-gb"] != "0" and tiny["specfleet/speed"] == "123456.75"
    assert all(re.fullmatch(NAME_PATTERN, value) for value in tiny.values())  # Ray's label value syntax


def test_inventory_round_trips_through_a_dump() -> None:
    inventory = load_inventory(FLEET)
    assert Inventory.model_validate(inventory.model_dump()) == inventory


def test_the_inventory_read_back_from_node_labels_equals_the_declared_one() -> None:
    from placement.inventory import inventory_from_labels

    declared = load_inventory(Path(__file__).resolve().parents[2] / "deploy" / "configs" / "fleet.yaml")
    labels = [ray_labels(n) for n in reversed(declared.nodes)] + [{"ray.io/node-id": "x"}]  # an unlabelled node
    assert inventory_from_labels(labels).nodes == sorted(declared.nodes, key=lambda n: n.name)
    with pytest.raises(ConfigError, match="specfleet labels"):
        inventory_from_labels([{}])
