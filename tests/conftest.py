"""Session-wide pytest fixtures: tiny random-weight models (built on first use) and a real local 3-node Ray cluster."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch

from deploy import DEFAULT_INVENTORY
from deploy.infra import local_cluster, ray_node
from deploy.infra.local_cluster import ClusterState
from placement.inventory import Inventory, load_inventory
from tests.fixtures.tiny_models import (
    DRAFT_NOISE,
    FAMILIES,
    GENERIC_FAMILIES,
    build_tiny_model,
    perturbed_copy,
    write_tiny_gguf,
)


def pytest_configure(config: pytest.Config) -> None:
    # The tiny models run faster on one thread, and a second OpenMP thread fighting other processes
    # for the machine's 2 cores made runtimes swing by 100x. (Subprocesses, e.g. the CLI, are unaffected.)
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: a long-running test; deselect with -m 'not slow'")


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Each test starts from an RNG state of its own (from its id), whatever ran before it in its process: `make
    test` runs the unit tier on pytest-xdist workers, in an order that changes, so a test on random data it does not
    seed itself would otherwise see other data each run (and a failure would not replay alone)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


class LazyModels(Mapping[str, Path]):
    """Family -> model folder, built by `build` on first access and cached."""

    def __init__(self, build: Callable[[str], Path], families: tuple[str, ...] = FAMILIES) -> None:
        self._build = build
        self._families = families
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self._families:
            raise KeyError(family)
        if family not in self._built:
            self._built[family] = self._build(family)
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_models["llama"]` -> folder of the tiny llama model (weights, config, generation config, tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return LazyModels(lambda family: build_tiny_model(family, root / family))


@pytest.fixture(scope="session")
def tiny_generic_models(tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_generic_models["gemma3_text"]` -> folder of a tiny model of a family only the generic path runs."""
    root = tmp_path_factory.mktemp("tiny-generic-models")
    return LazyModels(lambda family: build_tiny_model(family, root / family), GENERIC_FAMILIES)


@pytest.fixture(scope="session")
def tiny_generic_drafts(tiny_generic_models: LazyModels, tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_generic_drafts["qwen3"]` -> a noisy copy of the tiny generic-family model: a draft of its own family."""
    root = tmp_path_factory.mktemp("tiny-generic-drafts")
    return LazyModels(lambda family: perturbed_copy(tiny_generic_models[family], root / family, DRAFT_NOISE),
                      GENERIC_FAMILIES)


@pytest.fixture(scope="session")
def tiny_draft_models(tiny_models: LazyModels, tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_draft_models["llama"]` -> folder of a noisy copy of the tiny llama that agrees with it only partly."""
    root = tmp_path_factory.mktemp("tiny-drafts")
    return LazyModels(lambda family: perturbed_copy(tiny_models[family], root / family, DRAFT_NOISE))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_models: LazyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of an F32 GGUF file, alone in its folder, holding the tiny llama model and its tokenizer."""
    return write_tiny_gguf(tiny_models["llama"], tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama-f32.gguf")


# ---- a real local multi-node Ray cluster: three nodes of deploy/configs/fleet.yaml ----------------------------
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
    inventory = load_inventory(DEFAULT_INVENTORY).first(FLEET_NODES)
    state_path = tmp_path_factory.mktemp("ray-cluster") / "cluster.json"
    # `up` cleans up after itself if it fails; the nodes get SIGTERM should this process die before `down`
    state = local_cluster.up(inventory, state_path, timeout_s=120.0, die_with_parent=True)
    try:
        yield RayCluster(state=state, state_path=state_path, inventory=inventory)
    finally:
        local_cluster.down(state_path)


@pytest.fixture(scope="module")
def ray_driver(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """This test process connected to `ray_cluster` as a driver, with the cluster's auth and its loopback address
    kept (deploy/infra/ray_node.py)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in local_cluster.client_env(ray_cluster.state).items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        ray_node.reload_auth()  # the cluster's token auth, whatever this process's Ray read at import
        ray_node.keep_address()
        ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
        try:
            yield ray_cluster
        finally:
            ray.shutdown()
