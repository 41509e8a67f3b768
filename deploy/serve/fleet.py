"""Plan the fleet where the app is built: resolve the models to files, read the cluster's inventory, plan once.

`build_app` (deploy/serve/app.py) calls `fleet_specs` once; each instance deployment is then given its own
InstanceSpec (placement/fleet.py), so no instance actor plans, reads the cluster, or fetches a model. A change
of nodes is handled by building the app again (`specfleet serve` or a RayService update): the same function
plans the fleet over the new inventory.

Catalog names are fetched here, on the node that builds the app; on a multi-node cluster the model cache
(~/.cache/specfleet-models) must be shared or baked into the image so that the paths resolve on every node.
"""

from __future__ import annotations

from actors.model.loader import load_model_config
from cluster.config import EngineConfig, SpecfleetConfig
from deploy.model_store import resolve_model
from placement.fleet import InstanceSpec, plan_fleet
from placement.inventory import LABEL_PREFIX, Inventory, inventory_from_labels
from placement.model_size import model_size_from_config

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def resolved(engine: EngineConfig) -> EngineConfig:
    """`engine` with its models resolved: catalog names fetched, GGUF files converted once to safetensors folders.
    The name clients use stays the configured one (`model.name`, else the catalog name or file stem)."""
    m = engine.model
    model = m.model_copy(update={"target": resolve_model(m.target, m.dtype), "name": m.served_name,
                                 "draft": resolve_model(m.draft, m.dtype) if m.draft else None})
    return engine.model_copy(update={"model": model})


def cluster_inventory() -> tuple[Inventory, dict[str, str], set[str]]:
    """The inventory the running cluster's live nodes declare in their labels, the pins of unnamed nodes, and
    the nodes that offer Ray GPUs.

    A node started by `specfleet cluster up` carries its name (label `specfleet/node`) and the custom resource
    that pins work to it. A pod of a KubeRay worker group carries every label but the name (its group's pods
    are interchangeable): it is named after its accelerator kind and address, and pinned by Ray's own
    `node:<ip>` resource.
    """
    import ray  # only here: `specfleet generate` resolves configs without starting Ray

    nodes, pins, gpu_nodes = [], {}, set()
    for n in ray.nodes():
        labels = dict(n["Labels"])
        if not n["Alive"] or f"{LABEL_PREFIX}accelerator" not in labels:
            continue
        if f"{LABEL_PREFIX}node" not in labels:
            address = n["NodeManagerAddress"]
            name = f"{labels[LABEL_PREFIX + 'accelerator']}-{address.replace('.', '-').replace(':', '-')}"
            labels[f"{LABEL_PREFIX}node"], pins[name] = name, f"node:{address}"
        nodes.append(labels)
        if n["Resources"].get("GPU", 0) > 0:
            gpu_nodes.add(labels[f"{LABEL_PREFIX}node"])
    return inventory_from_labels(nodes), pins, gpu_nodes


def fleet_specs(cfg: SpecfleetConfig, inventory: Inventory | None = None, pins: dict[str, str] | None = None,
                gpu_nodes: set[str] | None = None) -> list[InstanceSpec]:
    """Every instance's spec for `cfg` over `inventory` (default: the running cluster's, with its pins and GPUs)."""
    if inventory is None:
        inventory, pins, gpu_nodes = cluster_inventory()
    engine = resolved(cfg.engine)
    m = engine.model
    dtype_bytes = DTYPE_BYTES[m.dtype]
    target = model_size_from_config(load_model_config(m.target), dtype_bytes=dtype_bytes)
    draft = model_size_from_config(load_model_config(m.draft), dtype_bytes=dtype_bytes) if m.draft else None
    return plan_fleet(engine, cfg.router, inventory, target, draft, pins=pins, gpu_nodes=gpu_nodes or set())
