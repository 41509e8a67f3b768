"""Each overlay's serveConfigV2 parses as the project's own config and names an import path that imports."""

from __future__ import annotations

import importlib

import yaml

from cluster.config import load_config, parse_config
from deploy.infra.k8s_render import pod_config
from tests.k8s.manifests import ROOT

SERVICER = "deploy.rpc.specfleet_pb2_grpc.add_SpecfleetServicer_to_server"


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def test_serve_config_carries_the_specfleet_config(rayservice, overlay):
    serve = serve_config(rayservice)
    (app,) = serve["applications"]
    assert app["import_path"] == "deploy.app:build_app" and app["route_prefix"] == "/"
    config = parse_config(app["args"]["config"], source=f"{overlay} serveConfigV2")
    assert config == pod_config(load_config(ROOT / "k8s" / "overlays" / overlay / "specfleet-config.yaml"))
    assert config.serve.auth.api_keys_file == "/etc/specfleet/keys/api-keys"  # the files the head mounts
    assert serve["http_options"] == {"host": "0.0.0.0", "port": config.serve.http_port} and config.serve.http_port == 8000
    assert serve["grpc_options"] == {"port": config.serve.grpc_port, "grpc_servicer_functions": [SERVICER]}
    assert config.serve.grpc_port == 9000 and serve["proxy_location"] == "HeadOnly"
    assert not config.serve.auth.api_keys and not config.serve.auth.admin_keys  # keys only from the Secret


def test_cpu_demo_serves_what_make_serve_runs():
    demo = load_config(ROOT / "k8s" / "overlays" / "cpu-demo" / "specfleet-config.yaml")
    assert demo.engine == load_config(ROOT / "deploy" / "configs" / "default.yaml").engine


def test_instances_ask_only_for_resources_the_workers_offer(rayservice):
    (app,) = serve_config(rayservice)["applications"]
    wanted = parse_config(app["args"]["config"]).fleet.instance_resources
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert not wanted.keys() & cluster["headGroupSpec"].get("resources", {}).keys()  # never on the head
    for group in cluster["workerGroupSpecs"]:
        assert all(float(group["resources"].get(k, 0)) >= v for k, v in wanted.items()), group["groupName"]


def test_import_path_imports(rayservice):
    (app,) = serve_config(rayservice)["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    grpc_module, _, fn = serve_config(rayservice)["grpc_options"]["grpc_servicer_functions"][0].rpartition(".")
    assert importlib.util.find_spec("deploy.rpc") is not None, "deploy/rpc (specfleet.proto, codegen) is missing"
    assert grpc_module.startswith("deploy.rpc.") and fn.startswith("add_") and fn.endswith("_to_server")
