"""Closed by default, on plain data: the local cluster's `ray start` commands, the loopback test, where Serve's
servers are moved to, and the `specfleet serve` job's environment."""

from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from deploy import DEFAULT_INVENTORY
from deploy.infra import local_cluster, ray_node
from deploy.serve import serve_env
from placement.inventory import load_inventory


@pytest.fixture
def nodes():
    inventory = load_inventory(DEFAULT_INVENTORY).first(2)
    return inventory.nodes, local_cluster._allocate_ports(2)


def test_every_node_is_pinned_to_its_address_and_the_head_runs_no_client_server(nodes) -> None:
    (head, worker), ports = nodes
    cmd = local_cluster.ray_start_command(head, None, ports[0], "/tmp/x", 1, 100)
    assert cmd[1:3] == ["-m", "deploy.infra.ray_node"]  # Ray's `ray start`, with the address kept as given
    assert "--node-ip-address=127.0.0.1" in cmd and "--include-dashboard=false" in cmd
    assert not [a for a in cmd if a.startswith("--ray-client-server-port")] and "--client-server" not in cmd
    with_client = local_cluster.ray_start_command(head, None, ports[0], "/tmp/x", 1, 100, client_server=True)
    assert "--client-server" in with_client and any(a.startswith("--ray-client-server-port") for a in with_client)
    joined = local_cluster.ray_start_command(worker, "10.0.0.5:6379", ports[1], "/tmp/y", 1, 100, host="10.0.0.5")
    assert "--node-ip-address=10.0.0.5" in joined and "--address=10.0.0.5:6379" in joined


def test_token_auth_follows_the_address(tmp_path) -> None:
    assert ray_node.is_loopback("127.0.0.1") and ray_node.is_loopback("::1") and ray_node.is_loopback("localhost")
    assert not ray_node.is_loopback("192.0.2.2") and not ray_node.is_loopback("0.0.0.0")
    assert ray_node.auth_env(None) == {"RAY_AUTH_MODE": "disabled"}
    assert ray_node.auth_env("/t") == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t"}
    with pytest.raises(Exception, match="auth"):
        local_cluster.up(load_inventory(DEFAULT_INVENTORY).first(1), tmp_path / "state.json", auth="maybe")


def test_serves_other_servers_move_from_every_interface_to_the_serve_host() -> None:
    assert serve_env.on_host("[::]:0", "127.0.0.1") == "127.0.0.1:0"
    assert serve_env.on_host("[::]:9000", "::1") == "[::1]:9000"
    assert serve_env.on_host("0.0.0.0:9000", "10.0.0.5") == "10.0.0.5:9000"
    assert serve_env.on_host("10.0.0.7:9000", "127.0.0.1") == "10.0.0.7:9000"  # a chosen address stays
    env = serve_env.runtime_env(ServeConfig(max_request_bytes=4096))
    assert env["worker_process_setup_hook"] == "deploy.serve.serve_env.bind_servers"
    assert env["env_vars"] == {"SPECFLEET_BIND_HOST": "127.0.0.1", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": "4096",
                               "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deploy.serve.proxy_guard.middlewares"}
    assert ServeConfig().http_host == "127.0.0.1"  # closed unless asked
    exposed = serve_env.runtime_env(ServeConfig(http_host="0.0.0.0"), replica_host="127.0.0.1")["env_vars"]
    assert exposed["SPECFLEET_BIND_HOST"] == "0.0.0.0" and exposed["SPECFLEET_REPLICA_HOST"] == "127.0.0.1"
    assert "SPECFLEET_REPLICA_HOST" not in serve_env.runtime_env(ServeConfig(), replica_host="127.0.0.1")["env_vars"]
