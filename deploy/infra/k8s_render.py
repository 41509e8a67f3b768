"""KubeRay manifests from a node inventory and a SpecfleetConfig: pure functions over plain data, no Ray.

One fleet description drives both the placement planner and Kubernetes: every accelerator kind of the
inventory becomes one RayService worker group whose pods carry the Ray custom resources and labels that
`placement/inventory.py` (`ray_resources`, `ray_labels`) gives a node of that kind. A worker group is a
set of interchangeable pods, so the per-node pin (`specfleet_node_<name>`) and the `specfleet/node`
label cannot be given to each pod; they are left out, and pods of a group are told apart by kind
(`accelerator_<kind>`, `specfleet/accelerator`) and by the `specfleet/group` label (docs/kubernetes.md). The app
names a group's pods by their place in it and pins work by the kind's resource (deploy/serve/fleet.py), never
by a pod's address, so a pod that replaces another is used like it.

Closed by default (docs/security.md): Ray token auth (`authOptions: {mode: token}`: the operator generates the
token and gives it to every Ray container and to its own dashboard client), the API keys from the Secret mounted
as files into the head alone (where the API replicas are pinned by the `specfleet_api` resource), no Ray client
port, and the gRPC message limit in the head's environment. k8s/base/networkpolicy.yaml admits Ray's ports only
from the cluster's own pods and the operator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from cluster.config import ConfigError, SpecfleetConfig
from placement.inventory import LABEL_PREFIX, MAX_PODS_LABEL, NODE_RESOURCE, Inventory, NodeSpec, ray_labels, ray_resources
from deploy.serve.serve_env import PROXY_CALLBACK, PROXY_CALLBACK_ENV

API_VERSION = "ray.io/v1"
RAY_VERSION = "2.60.0"  # pyproject's ray[serve] pin; the image must carry the same Ray
IMPORT_PATH = "deploy.app:build_app"
GRPC_SERVICER = "deploy.rpc.specfleet_pb2_grpc.add_SpecfleetServicer_to_server"
APP_LABEL = {"app.kubernetes.io/name": "specfleet"}
DASHBOARD_AGENT_PORT = 52365  # Ray's default dashboard agent port, which answers the raylet health check
GPU_RESOURCE = "nvidia.com/gpu"
KEYS_DIR = "/etc/specfleet/keys"  # where the head mounts the Secret with the API keys
API_RESOURCE = "specfleet_api"  # a Ray resource only the head offers: the API replicas, which read the keys, run there


@dataclass(frozen=True)
class RenderOptions:
    """How to render. `gpu=False` simulates the accelerators on CPU pods (labels and resources only)."""

    name: str = "specfleet"
    image: str = "specfleet:0.1.0"
    gpu: bool = True
    node_label: str = f"{LABEL_PREFIX}accelerator"  # Kubernetes node label whose value is the accelerator kind
    max_scale: int = 2  # a group may grow to max_scale x its inventory node count
    cpus_per_device: int = 8  # worker CPUs per accelerator (gpu=True); CPU pods get sim_cpus
    sim_cpus: int = 2
    head_cpus: int = 2
    head_memory: str = "8Gi"
    secret: str = "specfleet-api-keys"  # holds `api-keys` and `admin-keys` (keys separated by commas or lines)


def group_name(kind: str) -> str:
    """A worker group name (a DNS-1123 label) for an accelerator kind: 'A100_80g' -> 'a100-80g'."""
    name = re.sub(r"[^a-z0-9-]+", "-", kind.lower()).strip("-")
    if not name:
        raise ConfigError(f"accelerator kind {kind!r} gives an empty worker group name")
    return name[:63].rstrip("-")


def kinds(inventory: Inventory) -> dict[str, list[NodeSpec]]:
    """Nodes by accelerator kind, in inventory order; ConfigError if nodes of one kind differ in shape."""
    by_kind: dict[str, list[NodeSpec]] = {}
    for node in inventory.nodes:
        by_kind.setdefault(node.accelerator, []).append(node)
    for kind, nodes in by_kind.items():
        shapes = {(n.count, n.memory_gb, n.speed) for n in nodes}
        if len(shapes) > 1:
            raise ConfigError(f"nodes of accelerator kind {kind!r} ({', '.join(n.name for n in nodes)}) differ in "
                              "count, memory_gb or speed; one worker group needs one pod shape: give them distinct kinds")
    names = [group_name(k) for k in by_kind]
    if len(set(names)) < len(names):
        raise ConfigError(f"accelerator kinds {list(by_kind)} collide as worker group names {names}")
    return by_kind


def group_resources(node: NodeSpec, opts: RenderOptions) -> dict[str, str]:
    """Ray resources of a pod of `node`'s kind (KubeRay's top-level `resources`): ray_resources less the node pin."""
    out = {"CPU": str(_cpus(node, opts))}
    if opts.gpu:
        out["GPU"] = str(node.count)
    for key, value in ray_resources(node).items():
        if key != NODE_RESOURCE.format(name=node.name):
            out[key] = _quantity(value)
    return out


def group_labels(node: NodeSpec, max_replicas: int) -> dict[str, str]:
    """Ray labels of a pod of `node`'s kind: ray_labels less `specfleet/node`, plus `specfleet/group` and its
    `maxReplicas` as `specfleet/max-pods` (a scale-out then knows when no pod of the group can come)."""
    labels = {k: v for k, v in ray_labels(node).items() if k != f"{LABEL_PREFIX}node"}
    return {**labels, f"{LABEL_PREFIX}group": group_name(node.accelerator), MAX_PODS_LABEL: str(max_replicas)}


def worker_groups(inventory: Inventory, config: SpecfleetConfig, opts: RenderOptions) -> list[dict]:
    """One worker group per accelerator kind: replicas = minReplicas = its node count, up to max_scale x."""
    groups = []
    for kind, nodes in kinds(inventory).items():
        node, n = nodes[0], len(nodes)
        name = group_name(kind)
        cpus = _cpus(node, opts)
        limits: dict[str, str | int] = {"cpu": str(cpus), "memory": f"{_host_memory_gi(node, opts)}Gi"}
        if opts.gpu:
            limits[GPU_RESOURCE] = str(node.count)
        pod: dict = {
            "containers": [{
                "name": "ray-worker",
                "image": opts.image,
                "imagePullPolicy": "IfNotPresent",
                "resources": {"requests": dict(limits), "limits": dict(limits)},
                "ports": [{"name": "metrics", "containerPort": 8080}],
                # engines, not Serve proxies, run here (proxy_location HeadOnly), so readiness is the
                # raylet's health rather than KubeRay's default Serve-proxy check
                "readinessProbe": {"httpGet": {"path": "/api/local_raylet_healthz", "port": DASHBOARD_AGENT_PORT},
                                   "periodSeconds": 5, "failureThreshold": 10},
            }],
        }
        if opts.gpu:
            pod["nodeSelector"] = {opts.node_label: kind}
            pod["tolerations"] = [
                {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                {"key": opts.node_label, "operator": "Equal", "value": kind, "effect": "NoSchedule"},
            ]
        groups.append({
            "groupName": name,
            "replicas": n,
            "minReplicas": n,
            "maxReplicas": n * opts.max_scale,
            "rayStartParams": {},
            "resources": group_resources(node, opts),
            "labels": group_labels(node, n * opts.max_scale),
            "template": {"metadata": {"labels": {**APP_LABEL, f"{LABEL_PREFIX}group": name}}, "spec": pod},
        })
    return groups


def pod_capacity(node: NodeSpec, config: SpecfleetConfig, opts: RenderOptions) -> int:
    """At most how many instances one pod of `node`'s kind holds: the Ray resources an instance asks for (its CPUs,
    each of `pipeline_stages` shards, and `fleet.instance_resources`) against those the pod offers."""
    fleet = config.fleet
    asks = {"CPU": fleet.instance_num_cpus * fleet.pipeline_stages, **fleet.instance_resources}
    offers = {k: float(v) for k, v in group_resources(node, opts).items()}
    return min((int(offers.get(k, 0.0) // v) for k, v in asks.items() if v > 0), default=0)


def check_autoscaling(inventory: Inventory, config: SpecfleetConfig, opts: RenderOptions) -> None:
    """With `fleet.autoscaling`, the worker groups at their `maxReplicas` must hold `max_instances` (by the resources
    each instance asks for, `pod_capacity`): else Ray's autoscaler could never bring the pods the last scale-outs
    wait for. ConfigError naming what they hold and the flag that raises it."""
    scaling = config.fleet.autoscaling
    if scaling is None:
        return
    held = {group_name(kind): pod_capacity(nodes[0], config, opts) * len(nodes) * opts.max_scale
            for kind, nodes in kinds(inventory).items()}
    if sum(held.values()) < scaling.max_instances:
        raise ConfigError(f"fleet.autoscaling.max_instances is {scaling.max_instances}, but the worker groups at their "
                          f"maxReplicas (--max-scale {opts.max_scale} x the inventory's nodes) hold at most "
                          f"{sum(held.values())} instances ({', '.join(f'{g}: {n}' for g, n in held.items())}, by "
                          "the CPUs and fleet.instance_resources each instance asks for): raise --max-scale or "
                          "lower max_instances")


def head_group(config: SpecfleetConfig, opts: RenderOptions) -> dict:
    """The head: GCS, dashboard, the router, the Serve proxy and the API replicas (the only pods with the keys);
    no accelerator, no accelerator resources."""
    limits = {"cpu": str(opts.head_cpus), "memory": opts.head_memory}
    serve = config.serve
    return {
        # the operator deploys the Serve config through the dashboard from its own pod: it listens on the pod's
        # address, behind Ray token auth and the NetworkPolicy (the operator and the cluster's pods only)
        "rayStartParams": {"dashboard-host": "0.0.0.0"},
        "resources": {"CPU": str(opts.head_cpus), API_RESOURCE: "1"},
        "labels": {f"{LABEL_PREFIX}role": "head"},
        "template": {"metadata": {"labels": dict(APP_LABEL)}, "spec": {
            "containers": [{
                "name": "ray-head",
                "image": opts.image,
                "imagePullPolicy": "IfNotPresent",
                "resources": {"requests": dict(limits), "limits": dict(limits)},
                # Serve's gRPC proxy refuses a larger message itself; its HTTP proxy answers a key refused as a
                # whole until its Retry-After (deploy/serve/serve_env.py)
                "env": [{"name": "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "value": str(serve.max_request_bytes)},
                        {"name": PROXY_CALLBACK_ENV, "value": PROXY_CALLBACK}],
                "volumeMounts": [{"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True}],
                # no port for Ray's client server (10001): nothing outside the pod should reach it
                "ports": [
                    {"name": "gcs", "containerPort": 6379},
                    {"name": "dashboard", "containerPort": 8265},
                    {"name": "metrics", "containerPort": 8080},
                    {"name": "serve", "containerPort": serve.http_port},
                    {"name": "grpc", "containerPort": serve.grpc_port},
                ],
            }],
            # readable by the image's user (uid 1000) through the group fsGroup gives the files, by no one else
            "securityContext": {"fsGroup": 1000},
            "volumes": [{"name": "api-keys", "secret": {"secretName": opts.secret, "defaultMode": 0o440}}],
        }},
    }


def pod_config(config: SpecfleetConfig) -> SpecfleetConfig:
    """The config as the pods serve it: keys read from the files the head mounts, the API replicas pinned there."""
    auth = config.serve.auth
    if auth.api_keys or auth.admin_keys:
        raise ConfigError("serve.auth.api_keys/admin_keys are set in the config: on Kubernetes keys come from "
                          f"the Secret, mounted at {KEYS_DIR} in the head; remove them from the file")
    auth = auth.model_copy(update={"api_keys_file": f"{KEYS_DIR}/api-keys", "admin_keys_file": f"{KEYS_DIR}/admin-keys"})
    serve = config.serve.model_copy(update={"auth": auth, "api_resources": {API_RESOURCE: 0.001}})
    return config.model_copy(update={"serve": serve})


def serve_config(config: SpecfleetConfig) -> dict:
    """The Ray Serve config (serveConfigV2): deploy.app:build_app with the project's config (as `pod_config` makes
    it) inline. In a pod Serve listens on every interface: the Service and the NetworkPolicy decide who reaches it."""
    config = pod_config(config)
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": config.serve.http_port},
        "grpc_options": {"port": config.serve.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [{
            "name": "specfleet",
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": {"config": config.model_dump(mode="json", exclude_defaults=True)},
        }],
    }


def rayservice(inventory: Inventory, config: SpecfleetConfig, opts: RenderOptions) -> dict:
    """The whole RayService: serveConfigV2, head, one worker group per kind, autoscaler, upgrade strategy. Ray's
    autoscaler adds a group's pod when an instance's actor waits for resources only such a pod offers (our autoscaler
    plans a scale-out on the group's next pod, deploy/serve/fleet.py `nodes_inventory`), and removes a pod idle for
    `idleTimeoutSeconds` (after our scale-in drained and stopped its instances), within the group's bounds."""
    check_autoscaling(inventory, config, opts)
    return {
        "apiVersion": API_VERSION,
        "kind": "RayService",
        "metadata": {"name": opts.name, "labels": dict(APP_LABEL)},
        "spec": {
            # NewCluster: a changed cluster spec starts a second RayCluster and switches the serve Service to it
            # only once its applications are RUNNING; the old cluster serves until then (docs/kubernetes.md)
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": 120,  # in-flight generations on the old cluster get time to finish
            "serveConfigV2": _yaml(serve_config(config)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Ray token auth: KubeRay (v1.5.1+) generates a token Secret per RayCluster, sets RAY_AUTH_MODE and
                # RAY_AUTH_TOKEN in every Ray container, and sends the token with its own dashboard calls
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 300},
                "headGroupSpec": head_group(config, opts),
                "workerGroupSpecs": worker_groups(inventory, config, opts),
            },
        },
    }


def rayservice_patch(inventory: Inventory, config: SpecfleetConfig, opts: RenderOptions) -> dict:
    """A kustomize patch for the base RayService: serveConfigV2, head and worker groups (lists replace whole)."""
    cluster = rayservice(inventory, config, opts)["spec"]["rayClusterConfig"]
    return {
        "apiVersion": API_VERSION,
        "kind": "RayService",
        "metadata": {"name": opts.name},
        "spec": {"serveConfigV2": _yaml(serve_config(config)),
                 "rayClusterConfig": {key: cluster[key] for key in ("authOptions", "headGroupSpec", "workerGroupSpecs")}},
    }


def dump(doc: dict, header: str = "") -> str:
    """YAML text of `doc`, keys in the order built, after `header` lines turned into comments."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + _yaml(doc)


def _cpus(node: NodeSpec, opts: RenderOptions) -> int:
    return opts.cpus_per_device * node.count if opts.gpu else opts.sim_cpus


def _host_memory_gi(node: NodeSpec, opts: RenderOptions) -> int:
    # room in host RAM to stage the weights that fill the devices; simulated nodes hold small CPU models
    return max(16, int(node.count * node.memory_gb)) if opts.gpu else 4


def _quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6f}".rstrip("0")


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (serveConfigV2) as literal blocks."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


def _list(dumper: yaml.SafeDumper, items: list) -> yaml.SequenceNode:
    flat = bool(items) and all(isinstance(x, (int, float)) for x in items)  # e.g. draft_layers on one line
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flat)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)


def _yaml(doc: object) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
