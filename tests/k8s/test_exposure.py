"""No manifest exposes Ray's control plane (GCS 6379, dashboard and job API 8265, client server 10001) outside the
cluster or carries a literal key; Ray token auth and the NetworkPolicy are in place. Offline, on what kustomize
builds and on the committed files."""

from __future__ import annotations

import copy
import subprocess

import pytest
import yaml

from tests.k8s.manifests import ROOT, by_kind, kustomize

RAY_PORTS = {6379, 8265, 10001}
RAY_PORT_NAMES = {"gcs", "gcs-server", "dashboard", "client"}
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def _ray_port(port: object) -> bool:
    return port in RAY_PORTS or (isinstance(port, str) and (port in RAY_PORT_NAMES or port.isdigit()
                                                            and int(port) in RAY_PORTS))


def _pod_specs(doc: dict) -> list[dict]:
    """Every pod template's spec in a document (RayService / RayCluster groups, workloads)."""
    spec = doc.get("spec", {})
    cluster = spec.get("rayClusterConfig", spec) if doc.get("kind") in ("RayService", "RayCluster") else None
    if cluster is not None:
        groups = [cluster.get("headGroupSpec", {})] + cluster.get("workerGroupSpecs", [])
        return [g.get("template", {}).get("spec", {}) for g in groups]
    template = spec.get("template", {}).get("spec")
    return [template] if template else []


def problems(docs: list[dict]) -> list[str]:
    """Why these documents expose a Ray port outside the cluster or carry a literal key (empty: they do not)."""
    out = []
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        where = f"{kind}/{name}"
        spec = doc.get("spec", {})
        if kind == "Service" and (spec.get("type") in ("NodePort", "LoadBalancer") or spec.get("externalIPs")):
            out += [f"{where}: exposes port {p}" for p in spec.get("ports", [])
                    if _ray_port(p.get("port")) or _ray_port(p.get("targetPort"))]
        if kind == "Ingress":
            for rule in spec.get("rules", []):
                for path in rule.get("http", {}).get("paths", []):
                    port = path.get("backend", {}).get("service", {}).get("port", {})
                    if _ray_port(port.get("number")) or _ray_port(port.get("name")):
                        out.append(f"{where}: routes to Ray port {port}")
        if kind == "NetworkPolicy":
            for rule in spec.get("ingress", []):
                open_to_all = not rule.get("from") or any(p.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0")
                                                          for p in rule["from"])
                ports = [p.get("port") for p in rule.get("ports", [])]
                if open_to_all and (not ports or any(_ray_port(p) for p in ports)):
                    out.append(f"{where}: admits {ports or 'every port'} from anywhere")
        if kind in ("RayService", "RayCluster"):
            cluster = spec.get("rayClusterConfig", spec)
            head = cluster.get("headGroupSpec", {})
            if head.get("serviceType") in ("NodePort", "LoadBalancer") or head.get("enableIngress"):
                out.append(f"{where}: the head's Service or Ingress is reachable from outside the cluster")
            if head.get("headService", {}).get("spec", {}).get("type") in ("NodePort", "LoadBalancer"):
                out.append(f"{where}: headService is reachable from outside the cluster")
            if cluster.get("authOptions", {}).get("mode") != "token":
                out.append(f"{where}: Ray token auth is off (authOptions.mode)")
            serve = yaml.safe_load(spec.get("serveConfigV2") or "{}") or {}
            for app in serve.get("applications", []):
                auth = app.get("args", {}).get("config", {}).get("serve", {}).get("auth", {})
                if auth.get("api_keys") or auth.get("admin_keys"):
                    out.append(f"{where}: literal API keys in serveConfigV2")
        if kind == "Secret" and (doc.get("data") or doc.get("stringData")):
            out.append(f"{where}: a Secret with its values in the manifests")
        for pod in _pod_specs(doc):
            if pod.get("hostNetwork"):
                out.append(f"{where}: hostNetwork puts Ray's ports on the node's address")
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                out += [f"{where}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
                out += [f"{where}: literal {e['name']}" for e in c.get("env", [])
                        if "value" in e and any(w in e["name"].upper() for w in SECRET_WORDS)]
    return out


@pytest.mark.parametrize("target", ["base", "cpu-demo", "gpu-hetero"])
def test_no_manifest_exposes_ray_or_carries_a_literal_key(target):
    docs = kustomize(target)
    found = problems([d for d in docs if d["kind"] != "Secret"])  # cpu-demo's Secret comes from the user's file
    assert found == [], found
    for secret in by_kind(docs, "Secret"):  # generated from k8s/overlays/cpu-demo/api-keys.env, which the user writes
        assert target == "cpu-demo" and secret["metadata"]["name"] == "specfleet-api-keys"


def test_the_committed_files_hold_no_secret_and_no_key_file():
    files = subprocess.run(["git", "ls-files", "k8s"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert files and not [f for f in files if f.endswith((".env", ".key", ".pem"))]
    docs = [d for f in files if f.endswith((".yaml", ".yml")) for d in yaml.safe_load_all((ROOT / f).read_text()) if d]
    assert not by_kind(docs, "Secret") and problems(by_kind(docs, "Secret")) == []
    assert "api-keys.env" in (ROOT / ".gitignore").read_text()  # the demo's keys file stays out of the repository


def test_ray_ports_admit_only_the_clusters_own_pods_and_the_operator(overlay):
    (policy,) = by_kind(kustomize(overlay), "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "specfleet"}
    assert spec["policyTypes"] == ["Ingress"]
    rules = spec["ingress"]
    open_rules = [r for r in rules if not r.get("from")]
    assert [sorted(p["port"] for p in r["ports"]) for r in open_rules] == [[8000, 9000]]  # the app, from anywhere
    peers = [p for r in rules for p in r.get("from", [])]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specfleet"}}} in peers
    operator = [r for r in rules if any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
                                        == "kuberay-operator" for p in r.get("from", []))]
    assert operator and {p["port"] for p in operator[0]["ports"]} == {8265, 52365}
    # no rule admits a label from any namespace (anyone who can label a pod in their own namespace would match):
    # each namespace is chosen by the name Kubernetes sets on it, which its users cannot change
    for peer in peers:
        if "namespaceSelector" in peer:
            assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}, peer
            assert peer.get("podSelector", {}).get("matchLabels"), peer  # and a pod within it, by its labels
    assert operator[0]["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name":
                                                                          "kuberay-system"}
    # Ray's metrics (8080): the cluster's own pods (the rule for every port) and Prometheus's pods only
    metrics = [r for r in rules if r.get("from") and 8080 in {p["port"] for p in r.get("ports", [])}]
    assert [[p["podSelector"]["matchLabels"] for p in r["from"]] for r in metrics] == [
        [{"app.kubernetes.io/name": "prometheus"}]]


def test_ray_token_auth_is_on_and_no_client_port_is_declared(rayservice):
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # the operator generates the token Secret (KubeRay 1.5.1+)
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert 10001 not in {p["containerPort"] for p in head["ports"]}
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(1 << 20)  # the proxy refuses larger messages itself


def test_the_checks_can_fail(rayservice):
    bad_service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "head"},
                   "spec": {"type": "LoadBalancer", "ports": [{"port": 8265, "targetPort": "dashboard"}]}}
    open_policy = {"kind": "NetworkPolicy", "metadata": {"name": "x"}, "spec": {"ingress": [{}]}}
    ingress = {"kind": "Ingress", "metadata": {"name": "x"}, "spec": {"rules": [{"http": {"paths": [
        {"backend": {"service": {"name": "specfleet-head-svc", "port": {"number": 10001}}}}]}}]}}
    secret = {"kind": "Secret", "metadata": {"name": "k"}, "stringData": {"api-keys": "sk-1"}}
    exposed = copy.deepcopy(rayservice)
    cluster = exposed["spec"]["rayClusterConfig"]
    cluster["headGroupSpec"]["serviceType"] = "NodePort"
    cluster["authOptions"] = {"mode": "disabled"}
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["ports"].append({"name": "client", "containerPort": 10001, "hostPort": 10001})
    head["env"].append({"name": "RAY_AUTH_TOKEN", "value": "abc"})
    found = problems([bad_service, open_policy, ingress, secret, exposed])
    for what in ("Service/head", "NetworkPolicy/x", "Ingress/x", "Secret/k", "reachable from outside",
                 "token auth is off", "hostPort 10001", "literal RAY_AUTH_TOKEN"):
        assert any(what in p for p in found), (what, found)
