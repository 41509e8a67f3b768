"""Plan the fleet where the app is built: resolve the models to files, read the cluster's inventory, plan once.

`build_app` (deploy/serve/app.py) calls `fleet_specs` once; each instance deployment is then given its own
InstanceSpec (placement/fleet.py), so no instance actor plans, reads the cluster, or fetches a model. When an
instance deployment starts again (Serve replaced it: its instance or its node died), it checks that its place
still exists and is free; if not, `replan` places it again over the nodes alive now with the same planner
(placement/fleet.py, plan_instance), and waits for a node to join if there is no room.

Catalog names are fetched here, on the node that builds the app; on a multi-node cluster the model cache
(~/.cache/specfleet-models) must be shared or baked into the image so that the paths resolve on every node.
"""

from __future__ import annotations

import logging

from actors.model.device import choose_dtype
from actors.model.loader import load_model_config
from cluster.config import EngineConfig, FleetConfig, SpecfleetConfig
from deploy import model_store
from deploy.model_store import resolve_model
from placement.fleet import InstanceSpec, plan_fleet, plan_instance
from placement.inventory import ACCELERATOR_RESOURCE, LABEL_PREFIX, MAX_PODS_LABEL, Inventory, inventory_from_labels
from placement.model_size import model_size_from_config

log = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def resolved(engine: EngineConfig, gpu: bool | None = None) -> EngineConfig:
    """`engine` with its models resolved: `dtype: auto` chosen for the hardware (`gpu`: the fleet computes on GPUs;
    default: whether `engine.model.device` or this machine says so), catalog names fetched, GGUF files converted
    once to safetensors folders. The name clients use stays the configured one (`model.name`, else the catalog name
    or file stem)."""
    m = engine.model
    dtype, why = choose_dtype(m.dtype, gpu, m.device)
    if m.dtype == "auto":
        log.info("dtype %s (%s)", dtype, why)
    model = m.model_copy(update={"target": resolve_model(m.target, dtype), "name": m.served_name, "dtype": dtype,
                                 "draft": resolve_model(m.draft, dtype) if m.draft else None})
    return engine.model_copy(update={"model": model})


def cluster_inventory(spare_pods: bool = False) -> tuple[Inventory, dict[str, str], set[str]]:
    """The inventory the running cluster's live nodes declare in their labels, the pins of unnamed nodes, and
    the nodes that offer Ray GPUs (`nodes_inventory` over `ray.nodes()`); `spare_pods`: with one more pod of each
    KubeRay worker group, not started yet (what the autoscaler plans a scale-out on when the live nodes are full)."""
    import ray  # only here: `specfleet generate` resolves configs without starting Ray

    return nodes_inventory(ray.nodes(), spare_pods)


def nodes_inventory(ray_nodes: list[dict], spare_pods: bool = False) -> tuple[Inventory, dict[str, str], set[str]]:
    """`cluster_inventory` over `ray.nodes()`'s records (plain data).

    A node started by `specfleet cluster up` carries its name (label `specfleet/node`) and the custom resource
    that pins work to it. A pod of a KubeRay worker group carries every label but the name: its group's pods are
    interchangeable, so they are named by their place in the group (`<group>-0`, `<group>-1`, ... in node-id
    order) and pinned by their kind's resource (`accelerator_<kind>`), never by address: a pod that replaces
    one with a new IP serves its slot as well as any other pod of the group.

    `spare_pods` adds, for each group, the pods its next slots would be (`<group>-<n>`, the group's labels): an
    instance planned there asks for the group's resources (its kind's pin, its accelerator memory, GPUs), which no
    live pod has free, so its actor waits and Ray's autoscaler adds a pod of that group (docs/kubernetes.md). As
    many as the group may still grow by: up to its `maxReplicas` (the `specfleet/max-pods` label k8s_render gives
    its pods; one spare where a pod has no such label), so a step of several instances has a slot for each, and a
    group at its `maxReplicas` has none: a plan that needs a pod fails now rather than after the load timeout.
    Nodes of `specfleet cluster up` are never added: they are not in a group that can grow.
    """
    nodes, pins, gpu_nodes, pods = [], {}, set(), {}
    last: dict[str, tuple[dict[str, str], bool]] = {}  # group -> (its last pod's labels, whether it has GPUs)
    for n in sorted(ray_nodes, key=lambda n: n["NodeID"]):
        labels = dict(n["Labels"])
        if not n["Alive"] or f"{LABEL_PREFIX}accelerator" not in labels:
            continue
        gpu = n["Resources"].get("GPU", 0) > 0
        if f"{LABEL_PREFIX}node" not in labels:
            kind = labels[f"{LABEL_PREFIX}accelerator"]
            group = labels.get(f"{LABEL_PREFIX}group") or kind
            slot = pods[group] = pods.get(group, -1) + 1
            name = f"{group}-{slot}"
            labels[f"{LABEL_PREFIX}node"], pins[name] = name, ACCELERATOR_RESOURCE.format(kind=kind)
            last[group] = (labels, gpu)
        nodes.append(labels)
        if gpu:
            gpu_nodes.add(labels[f"{LABEL_PREFIX}node"])
    for group, (labels, gpu) in last.items() if spare_pods else ():
        live = pods[group] + 1
        room = int(labels[MAX_PODS_LABEL]) - live if MAX_PODS_LABEL in labels else 1
        for slot in range(live, live + room):
            name = f"{group}-{slot}"
            nodes.append({**labels, f"{LABEL_PREFIX}node": name})
            pins[name] = pins[labels[f"{LABEL_PREFIX}node"]]
            if gpu:
                gpu_nodes.add(name)
    return inventory_from_labels(nodes), pins, gpu_nodes


def fleet_specs(cfg: SpecfleetConfig, inventory: Inventory | None = None, pins: dict[str, str] | None = None,
                gpu_nodes: set[str] | None = None) -> list[InstanceSpec]:
    """Every instance's spec for `cfg` over `inventory` (default: the running cluster's, with its pins and GPUs)."""
    if inventory is None:
        inventory, pins, gpu_nodes = cluster_inventory()
    device = cfg.engine.model.device
    engine = resolved(cfg.engine, gpu=device == "cuda" or (device == "auto" and bool(gpu_nodes)))
    m = engine.model
    dtype_bytes = DTYPE_BYTES[m.dtype]
    target = model_size_from_config(load_model_config(m.target), dtype_bytes=dtype_bytes)
    draft = model_size_from_config(load_model_config(m.draft), dtype_bytes=dtype_bytes) if m.draft else None
    specs = plan_fleet(engine, cfg.fleet, inventory, target, draft, pins=pins, gpu_nodes=gpu_nodes or set())
    # a goodput calibration is kept between starts, so a replacement reads it back instead of timing it
    return [s.model_copy(update={"calibration_dir": str(model_store.calibration_dir())}) for s in specs]


def replan(spec: InstanceSpec, fleet: FleetConfig, index: int, taken: set[tuple[str, int]],
           spare_pods: bool = False) -> InstanceSpec:
    """`spec` (instance `index`, its engine resolved) as it should start now: itself if every node it names is alive
    and none of its devices is `taken` by another instance, else planned again over the live nodes
    (placement/fleet.py, plan_instance), its calibration store and role kept; `spare_pods`: and over one more pod of
    each KubeRay worker group (`nodes_inventory`). PlacementError if there is no room."""
    inventory, pins, gpu_nodes = cluster_inventory(spare_pods)
    alive = {n.name for n in inventory.nodes}
    if {node for node, _ in spec.layout.places} <= alive and spec.layout.places.isdisjoint(taken):
        return spec
    m = spec.engine.model
    dtype_bytes = DTYPE_BYTES[m.dtype]
    target = model_size_from_config(load_model_config(m.target), dtype_bytes=dtype_bytes)
    draft = model_size_from_config(load_model_config(m.draft), dtype_bytes=dtype_bytes) if m.draft else None
    prefix = spec.instance_id.rsplit("-", 1)[0]
    placed = plan_instance(spec.engine, fleet, inventory, target, draft, index, taken=taken, pins=pins,
                           gpu_nodes=gpu_nodes, prefix=prefix)
    return placed.model_copy(update={"calibration_dir": spec.calibration_dir, "role": spec.role})


def live_nodes() -> set[str]:
    """The names of the cluster's nodes Ray counts alive now (as `cluster_inventory` names them)."""
    return {n.name for n in cluster_inventory()[0].nodes}
