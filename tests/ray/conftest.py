"""Session fixtures for tests on a real local multi-node Ray cluster: three nodes of deploy/configs/fleet.yaml."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from deploy import local_cluster
from deploy.local_cluster import ClusterState
from placement.inventory import Inventory, load_inventory

FLEET_NODES = 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that use `ray_cluster` last (in their order), so the cluster lives only for the session's tail."""
    uses = ["ray_cluster" in getattr(item, "fixturenames", ()) for item in items]
    items[:] = [i for i, u in zip(items, uses) if not u] + [i for i, u in zip(items, uses) if u]


@dataclass(frozen=True)
class RayCluster:
    """A running local cluster: its recorded state, and the state file `specfleet cluster` commands read."""

    state: ClusterState
    state_path: Path
    inventory: Inventory

    @property
    def address(self) -> str:
        return self.state.address


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """A head and two workers started with `specfleet cluster up`'s code; stopped with its `down` at the end."""
    inventory = load_inventory(local_cluster.DEFAULT_INVENTORY).first(FLEET_NODES)
    state_path = tmp_path_factory.mktemp("ray-cluster") / "cluster.json"
    # `up` cleans up after itself if it fails; the nodes get SIGTERM should this process die before `down`
    state = local_cluster.up(inventory, state_path, timeout_s=120.0, die_with_parent=True)
    try:
        yield RayCluster(state=state, state_path=state_path, inventory=inventory)
    finally:
        local_cluster.down(state_path)


@pytest.fixture(scope="module")
def ray_driver(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """This test process connected to `ray_cluster` as a driver, with the cluster's RAY_AUTH_MODE."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in local_cluster.RAY_ENV.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
        try:
            yield ray_cluster
        finally:
            ray.shutdown()
