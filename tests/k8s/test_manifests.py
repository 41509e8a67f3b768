"""The kustomize base and overlays build offline and every document validates (KubeRay CRDs, core kinds)."""

from __future__ import annotations

import pytest

from placement.inventory import load_inventory
from tests.k8s.manifests import ROOT, assert_valid, by_kind, kustomize, validation_errors

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize("target", ["base", "cpu-demo", "gpu-hetero"])
def test_every_document_validates(target):
    docs = kustomize(target)
    assert {"RayService", "Service", "PodMonitor", "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    assert_valid(docs)


def test_rayservice_shape(rayservice):
    spec = rayservice["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}  # an upgrade keeps the old cluster serving
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    (head_container,) = head["template"]["spec"]["containers"]
    assert GPU not in str(head) and not any(k.startswith("accelerator_") for k in head.get("resources", {}))
    assert {p["name"]: p["containerPort"] for p in head_container["ports"]}.items() >= {"serve": 8000, "grpc": 9000}.items()
    for group in cluster["workerGroupSpecs"]:
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert "labels" not in group["rayStartParams"]  # KubeRay refuses it; the top-level `labels` field is used
        assert not ({"num-cpus", "num-gpus", "resources"} & group["rayStartParams"].keys())  # conflicts with `resources`


def test_api_keys_are_mounted_from_the_secret_into_the_head_alone(rayservice):
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    (volume,) = head["volumes"]
    assert volume["secret"]["secretName"] == "specfleet-api-keys" and volume["secret"]["defaultMode"] == 0o440
    (mount,) = head["containers"][0]["volumeMounts"]
    assert (mount["name"], mount["mountPath"], mount["readOnly"]) == (volume["name"], "/etc/specfleet/keys", True)
    assert cluster["headGroupSpec"]["resources"]["specfleet_api"] == "1"  # the API replicas are pinned here
    for group in cluster["workerGroupSpecs"]:  # engines never see a key
        assert "specfleet-api-keys" not in str(group) and "volumes" not in group["template"]["spec"]
    for container in _containers(rayservice):
        assert not [e for e in container.get("env", []) if "KEYS" in e["name"]]


def test_cpu_demo_simulates_the_demo_fleet_without_gpus():
    docs = kustomize("cpu-demo")
    (svc,) = by_kind(docs, "RayService")
    groups = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert GPU not in str(svc) and all("nodeSelector" not in g["template"]["spec"] for g in groups)
    fleet = load_inventory(ROOT / "deploy" / "configs" / "fleet.yaml")
    assert [g["labels"]["specfleet/accelerator"] for g in groups] == list(dict.fromkeys(n.accelerator for n in fleet.nodes))
    assert sum(g["replicas"] for g in groups) == len(fleet.nodes)
    (secret,) = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "specfleet-api-keys" and {"api-keys", "admin-keys"} <= secret["data"].keys()
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"specfleet-demo"}
    assert all(c["image"] == "specfleet:0.1.0-cpu" for c in _containers(svc))


def test_gpu_hetero_pins_each_kind_to_its_gpu_nodes():
    (svc,) = by_kind(kustomize("gpu-hetero"), "RayService")
    groups = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len({g["labels"]["specfleet/accelerator"] for g in groups}) == len(groups) >= 3
    for g in groups:
        kind, pod = g["labels"]["specfleet/accelerator"], g["template"]["spec"]
        assert pod["nodeSelector"] == {"specfleet/accelerator": kind}
        assert any(t["key"] == GPU for t in pod["tolerations"])
        (container,) = pod["containers"]
        assert container["resources"]["limits"][GPU] == g["labels"]["specfleet/count"] == g["resources"]["GPU"]
    assert all(c["image"] == "specfleet:0.1.0-cuda" for c in _containers(svc))
    assert not by_kind(kustomize("gpu-hetero"), "Secret")  # production keys are never in the repository


def test_service_exposes_http_and_grpc_on_serving_heads(overlay):
    (service,) = [s for s in by_kind(kustomize(overlay), "Service") if s["metadata"]["name"] == "specfleet"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (8000, "serve"), "grpc": (9000, "grpc")}
    assert service["spec"]["selector"]["ray.io/serve"] == "true"


def test_podmonitor_scrapes_ray_and_the_app(overlay):
    (monitor,) = by_kind(kustomize(overlay), "PodMonitor")
    assert {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]} == {("metrics", "/metrics"),
                                                                                         ("serve", "/metrics")}


def test_the_validators_can_fail(rayservice):
    bad = dict(rayservice, spec={**rayservice["spec"], "upgradeStrategyy": {"type": "NewCluster"}})  # a typo
    assert validation_errors(bad)
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["minReplicas"] = "one"
    assert validation_errors(rayservice)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    assert validation_errors(service)
    assert validation_errors({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
                              "spec": {"podMetricsEndpoints": [{"path": "/metrics"}]}})


def _containers(svc: dict) -> list[dict]:
    cluster = svc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]
