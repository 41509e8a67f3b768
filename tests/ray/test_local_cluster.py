"""`specfleet cluster`: real raylets with the inventory's labels and resources, pinned tasks, exact teardown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import ray

from deploy import DEFAULT_INVENTORY
from deploy.infra import local_cluster
from deploy.cli import main
from deploy.infra.local_cluster import ClusterError, ClusterState, read_state, running_processes
from placement.inventory import NODE_RESOURCE, load_inventory, ray_labels, ray_resources


def specfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=240)


def live_nodes() -> dict[str, dict]:
    """Alive nodes of the connected cluster by their specfleet/node label."""
    return {n["Labels"]["specfleet/node"]: n for n in ray.nodes() if n["Alive"]}


def test_every_node_is_its_own_raylet_with_the_inventorys_labels_and_resources(ray_driver) -> None:
    nodes = live_nodes()
    assert sorted(nodes) == sorted(spec.name for spec in ray_driver.inventory.nodes)
    for spec in ray_driver.inventory.nodes:
        node = nodes[spec.name]
        assert node["NodeName"] == spec.name
        assert ray_labels(spec).items() <= node["Labels"].items()
        for key, value in ray_resources(spec).items():
            assert node["Resources"][key] == pytest.approx(value)
        assert node["Resources"]["CPU"] == 4
    assert len({n["NodeManagerPort"] for n in nodes.values()}) == len(nodes)  # one raylet each
    assert len({n["ObjectStoreSocketName"] for n in nodes.values()}) == len(nodes)  # with its own temp folder
    recorded = ray_driver.state.nodes
    assert [n.head for n in recorded] == [True, False, False]
    running = {p.pid for p in running_processes(ray_driver.state)}
    assert {n.pid for n in recorded} <= running


def test_tasks_pinned_by_resource_or_label_run_on_the_named_node(ray_driver) -> None:
    node_ids = {name: node["NodeID"] for name, node in live_nodes().items()}

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    by_resource = {name: where.options(resources={NODE_RESOURCE.format(name=name): 1}).remote() for name in node_ids}
    by_label = {name: where.options(label_selector={"specfleet/node": name}).remote() for name in node_ids}
    on_l4 = [where.options(resources={"accelerator_l4-24g": 1}).remote() for _ in range(4)]
    assert {name: ray.get(ref, timeout=60) for name, ref in by_resource.items()} == node_ids
    assert {name: ray.get(ref, timeout=60) for name, ref in by_label.items()} == node_ids
    assert set(ray.get(on_l4, timeout=60)) <= {node_ids["l4-0"], node_ids["l4-1"]}


def test_every_nodes_workers_hold_the_same_link_secret_and_another_cluster_does_not(ray_driver) -> None:
    """KV links and pipeline groups authenticate with a secret derived from the cluster's Ray token
    (actors/transport/rendezvous.py): a worker on every node finds it, the same, and it is not the token itself."""
    from actors.transport.rendezvous import link_secret

    @ray.remote(num_cpus=0)
    def secret() -> bytes | None:
        return link_secret()

    nodes = [name for name in live_nodes()]
    got = ray.get([secret.options(resources={NODE_RESOURCE.format(name=n): 1}).remote() for n in nodes], timeout=60)
    token = Path(ray_driver.state.auth_token_path).read_text().strip().encode()
    assert got[0] is not None and len(set(got)) == 1 and token not in got[0]


def test_pinned_nodes_run_their_work_on_their_own_core(ray_driver) -> None:
    """`pin_nodes` (bench elastic --pin-cores): each node's processes, and the workers its raylet starts later, run on
    the one core given to that node."""
    state = ray_driver.state
    cores = sorted(os.sched_getaffinity(0))

    @ray.remote(num_cpus=0)
    def affinity() -> list[int]:
        return sorted(os.sched_getaffinity(0))

    try:
        pinned = local_cluster.pin_nodes(state)
        assert pinned == {n.spec.name: cores[i % len(cores)] for i, n in enumerate(state.nodes)}
        got = ray.get([affinity.options(resources={NODE_RESOURCE.format(name=n): 1}).remote() for n in pinned],
                      timeout=60)
        assert got == [[core] for core in pinned.values()]
    finally:  # the other tests share this cluster: give its processes every core back
        for node in state.nodes:
            for proc in local_cluster.node_processes(state, node):
                try:
                    proc.cpu_affinity(cores)
                except psutil.NoSuchProcess:
                    pass


def test_cli_up_status_down_stops_exactly_its_own_cluster(ray_driver, tmp_path: Path) -> None:
    state_path = tmp_path / "second.json"
    res = specfleet("cluster", "up", "--nodes", "1", "--num-cpus", "1", "--state", str(state_path))
    assert res.returncode == 0, res.stderr
    try:
        second = read_state(state_path)
        pids = {p.pid for p in running_processes(second)}
        assert second.address != ray_driver.address and pids
        assert pids.isdisjoint(p.pid for p in running_processes(ray_driver.state))

        res = specfleet("cluster", "status", "--json", "--state", str(state_path))
        assert res.returncode == 0, res.stderr
        [node] = json.loads(res.stdout)["nodes"]
        assert node["name"] == "a100" and node["head"] and node["alive"]
        assert node["labels"]["specfleet/accelerator"] == "a100-80g" and node["resources"]["CPU"] == 1

        res = specfleet("cluster", "down", "--state", str(state_path))
        assert res.returncode == 0, res.stderr
    finally:
        if state_path.exists():  # the CLI failed part-way: stop what it started
            local_cluster.down(state_path)
    left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == [] and running_processes(second) == []
    assert not Path(second.temp_dir).exists() and not state_path.exists()
    assert len(live_nodes()) == len(ray_driver.inventory.nodes)  # the session's cluster is untouched
    assert all(psutil.pid_exists(n.pid) for n in ray_driver.state.nodes)


def test_a_failed_start_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[local_cluster.NodeProcess] = []
    start_node = local_cluster._start_node

    def recording_start_node(*args: object) -> local_cluster.NodeProcess:
        started.append(start_node(*args))
        return started[-1]

    monkeypatch.setattr(local_cluster, "_start_node", recording_start_node)
    inventory = load_inventory(DEFAULT_INVENTORY).first(2)
    with pytest.raises(ClusterError, match="did not listen"):  # the head cannot be up within 0.2 s
        local_cluster.up(inventory, tmp_path / "state.json", timeout_s=0.2)
    [head] = started
    stopped = ClusterState(cluster_id="-", address="-", temp_dir=str(Path(head.temp_dir).parent), nodes=started)
    assert running_processes(stopped) == []  # nothing left in the head's session
    assert not Path(stopped.temp_dir).exists() and not (tmp_path / "state.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["up", "--nodes", "4"], "lists only 3 nodes"),
        (["up", "--nodes", "0"], "--nodes must be at least 1"),
        (["up", "--node-labels", "{bad_yaml}"], "not valid YAML"),
        (["up", "--node-labels", "{unknown_key}"], "nodes.0.gpus: unknown key"),
        (["up", "--node-labels", "/nonexistent/fleet.yaml"], "no such inventory file"),
        (["down"], "no cluster state"),
        (["status"], "no cluster state"),
    ],
)
def test_bad_input_is_a_clear_error_with_status_2(args: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    (tmp_path / "unknown.yaml").write_text("nodes:\n  - {name: a, accelerator: t4-16g, gpus: 2}\n")
    files = {"bad_yaml": tmp_path / "bad.yaml", "unknown_key": tmp_path / "unknown.yaml"}
    argv = ["cluster", *(a.format(**files) for a in args), "--state", str(tmp_path / "none.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specfleet: error:") and message in err
    assert not (tmp_path / "none.json").exists()


def test_worker_port_ranges_never_hold_rays_default_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI once drew 10000-10099 for a worker; `ray start` refused it for holding the client server's 10001."""
    draws = iter([10000 // local_cluster.WORKER_PORTS, 8200 // local_cluster.WORKER_PORTS] + [150 + i for i in range(50)])
    monkeypatch.setattr(local_cluster.random, "randrange", lambda *_: next(draws))
    for node in local_cluster._allocate_ports(3):
        ports = set(range(node["min_worker"], node["max_worker"] + 1))
        assert not ports & local_cluster.RAY_DEFAULT_PORTS
        assert node["min_worker"] >= 15000


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _listening(state: ClusterState) -> set[tuple[str, int, str]]:
    out = set()
    for proc in running_processes(state):
        try:
            out |= {(c.laddr.ip, c.laddr.port, proc.name()) for c in proc.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # exited since the listing
            pass
    return out


def test_every_port_of_the_cluster_listens_on_loopback_and_no_client_server_runs(ray_driver) -> None:
    listening = _listening(ray_driver.state)
    assert ray_driver.state.nodes[0].ports["gcs"] in {port for _, port, _ in listening}
    assert {(ip, port, name) for ip, port, name in listening if ip not in LOOPBACK} == set()
    client = [p for p in running_processes(ray_driver.state) if "ray.util.client.server" in " ".join(p.cmdline())]
    assert client == []
    # token auth on loopback too: another user of this machine reaches 127.0.0.1 as well
    assert ray_driver.state.auth_token_path and os.stat(ray_driver.state.auth_token_path).st_mode & 0o777 == 0o600
    without = _driver_without_token(ray_driver.state.address)
    assert without.returncode != 0 and "token" in without.stderr.lower(), without.stderr[-2000:]


def _driver_without_token(address: str) -> subprocess.CompletedProcess:
    """A driver that connects to `address` without the cluster's token (as another local user would)."""
    probe = ("import sys, ray; from deploy.infra import ray_node; ray_node.keep_address(); "
             "ray.init(address=sys.argv[1], logging_level='ERROR'); print(len(ray.nodes()))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # ray.init tries the GCS once a second, RAY_NUM_REDIS_GET_RETRIES times (20), before it gives up: a refusal is
    # the same on the second try as on the twentieth, and each try past it was a second of the suite's time
    env["RAY_NUM_REDIS_GET_RETRIES"] = "2"
    return subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=180,
                          env={**env, **local_cluster.RAY_ENV})


def _network_address() -> str:
    """This machine's address on its default route (no packet is sent), or a skip where there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
        except OSError:
            pytest.skip("this machine has no network address to bind a cluster to")
        return s.getsockname()[0]


def test_a_cluster_on_a_network_address_runs_with_ray_token_auth(tmp_path: Path) -> None:
    host = _network_address()
    state_path = tmp_path / "net.json"
    state = local_cluster.up(load_inventory(DEFAULT_INVENTORY).first(1), state_path, host=host, num_cpus=1,
                             die_with_parent=True)
    try:
        assert state.address.startswith(f"{host}:") and state.auth_token_path
        assert os.stat(state.auth_token_path).st_mode & 0o777 == 0o600
        without = _driver_without_token(state.address)
        assert without.returncode != 0 and "token" in without.stderr.lower()  # refused: no token
        nodes = local_cluster.query_nodes(state.address, expect=1, auth_token_path=state.auth_token_path)
        assert [n.alive for n in nodes] == [True]  # with the cluster's token
    finally:
        local_cluster.down(state_path)
