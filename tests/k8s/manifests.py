"""Offline checks of Kubernetes manifests: KubeRay CRD schemas (jsonschema), core kinds, kustomize builds."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "k8s-crds"
OVERLAYS = ("cpu-demo", "gpu-hetero")
KUBE_VERSION = kubernetes_validate.latest_version()  # a current Kubernetes the package ships schemas for
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
MONITOR_KINDS = ("PodMonitor", "ServiceMonitor")  # prometheus-operator CRDs: no schema here, shape checked


def strict(schema: object) -> object:
    """The schema with unknown fields refused where the CRD lists an object's fields and does not preserve
    unknown ones: the API server would silently prune them, so a typo would vanish without this."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(entry["schema"]["openAPIV3Schema"])  # x-kubernetes-* keys are unknown keywords: ignored
    return jsonschema.Draft7Validator(schema)


def validation_errors(doc: dict) -> list[str]:
    """Why `doc` is not a valid manifest (empty if it is)."""
    kind = doc.get("kind")
    if kind in CRD_FILES:
        if doc.get("apiVersion") != "ray.io/v1":
            return [f"{kind} must be ray.io/v1, got {doc.get('apiVersion')}"]
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(kind).iter_errors(doc)]
    if kind in MONITOR_KINDS:
        return monitor_errors(doc)
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
        return [f"{kind}: {e}"]
    return []


def monitor_errors(doc: dict) -> list[str]:
    spec = doc.get("spec", {})
    endpoints = spec.get("podMetricsEndpoints" if doc["kind"] == "PodMonitor" else "endpoints") or []
    problems = []
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        problems.append(f"apiVersion {doc.get('apiVersion')}")
    if not doc.get("metadata", {}).get("name"):
        problems.append("no metadata.name")
    if not spec.get("selector", {}).get("matchLabels"):
        problems.append("no spec.selector.matchLabels")
    if not endpoints or not all(e.get("port") and e.get("path", "/metrics").startswith("/") for e in endpoints):
        problems.append("every endpoint needs a named port and an absolute path")
    return problems


def assert_valid(docs: list[dict]) -> None:
    problems = {f"{d.get('kind')}/{d.get('metadata', {}).get('name')}": validation_errors(d) for d in docs}
    assert not {k: v for k, v in problems.items() if v}, problems


DEMO_KEYS = "api-keys=sk-test-demo-api\nadmin-keys=sk-test-demo-admin\n"  # what a user writes (cpu-demo)


@functools.cache
def _tree() -> Path:
    """A copy of k8s/ with the file a user creates for the cpu-demo overlay's keys (never in the repository)."""
    root = Path(tempfile.mkdtemp(prefix="specfleet-k8s-")) / "k8s"
    shutil.copytree(ROOT / "k8s", root)
    (root / "overlays" / "cpu-demo" / "api-keys.env").write_text(DEMO_KEYS)
    return root


@functools.cache
def _build(path: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    res = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def kustomize(overlay: str) -> list[dict]:
    """The documents `kubectl kustomize k8s/overlays/<overlay>` (or `k8s/base`) builds, offline."""
    path = _tree() / ("base" if overlay == "base" else f"overlays/{overlay}")
    return [d for d in yaml.safe_load_all(_build(str(path))) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]
