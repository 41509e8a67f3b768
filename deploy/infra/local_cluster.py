"""A real multi-node Ray cluster on this machine: one `ray start --block` per inventory node, tracked in a state file.

Each node is its own raylet with its own temp folder and ports, its inventory labels and custom resources
(placement/inventory.py). Every process of a cluster runs in one of the sessions (process groups) that `up`
creates, and carries the cluster's id in its environment (MARKER): `down` signals those groups and then
sweeps any process with the marker (Ray workers leave the group), so it stops exactly what `up` started.
It never runs `ray stop`, which would stop every Ray process on the host.

Closed by default (deploy/infra/ray_node.py): every node and every port of it is bound to `host` (127.0.0.1
unless asked), the dashboard is off and so is the Ray client server (`client_server` turns it on); every cluster,
on loopback too, runs with Ray token auth, its token in a file of mode 600 in the cluster's private temp folder
(another user of this machine reaches 127.0.0.1 as well, and a driver can run code as the server's user).
Clients connect with `connect(state)`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict

from deploy import DEFAULT_INVENTORY
from deploy.cli.flags import UsageError, read_json_file
from deploy.infra import ray_node
from placement.inventory import LABEL_PREFIX, Inventory, NodeSpec, ray_labels, ray_resources

log = logging.getLogger(__name__)
DEFAULT_STATE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specfleet" / "cluster.json"
MARKER = "SPECFLEET_LOCAL_CLUSTER"  # env var: the cluster id, inherited by every process of the cluster
# Every process started, and every client, uses these (plus the auth of client_env). No drain on SIGTERM: a local
# cluster stops at once.
RAY_ENV = {**ray_node.AUTH_OFF, "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
WORKER_PORTS = 100  # ports per node for Ray worker processes
# Ray's default ports: a worker's `ray start` checks its worker range against them even when unused there
# (CI once drew 10000-10099 and `ray start` refused it for holding the client server's default 10001)
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365, 8076, 44217, 44227})
_NODE_PORTS = ("node_manager", "object_manager", "dashboard_agent_listen", "dashboard_agent_grpc",
               "metrics_export", "runtime_env_agent")
_HEAD_PORTS = ("gcs", "dashboard", "ray_client_server")


class ClusterError(RuntimeError):
    """The cluster failed to start, to answer, or to stop; the message says which node and shows its log."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodeProcess(_Frozen):
    """One node: its spec, the `ray start --block` process leading its session, and its private folder and ports."""

    spec: NodeSpec
    head: bool
    pid: int
    create_time: float  # psutil's: with the pid, names the process even after the pid is reused
    temp_dir: str
    ports: dict[str, int]

    @property
    def log(self) -> Path:
        return Path(self.temp_dir) / "ray-start.log"


class ClusterState(_Frozen):
    """What `up` started, as written to the state file; `address` is the GCS address clients connect to, with the
    Ray auth token in `auth_token_path` (None: auth off, on loopback)."""

    cluster_id: str
    address: str
    temp_dir: str
    nodes: list[NodeProcess]
    auth_token_path: str | None = None


class LiveNode(_Frozen):
    """A node as the cluster's GCS reports it (ray.nodes())."""

    node_id: str
    alive: bool
    labels: dict[str, str]
    resources: dict[str, float]

    @property
    def name(self) -> str | None:
        return self.labels.get("specfleet/node")


def ray_env(cluster_id: str | None = None, auth_token_path: str | None = None) -> dict[str, str]:
    """The environment for a cluster's processes (with the marker) or for a client (without)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", MARKER, "RAY_AUTH_TOKEN")}
    env.update(RAY_ENV)
    env.update(ray_node.auth_env(auth_token_path))
    if cluster_id is not None:
        env[MARKER] = cluster_id
    return env


def client_env(state: ClusterState) -> dict[str, str]:
    """What a client of the cluster needs in its environment (RAY_ENV and the cluster's auth)."""
    return {**RAY_ENV, **ray_node.auth_env(state.auth_token_path)}


def connect(state: ClusterState, **init_kwargs) -> None:
    """Connect this process to the cluster as a driver (ray.init with its auth, the loopback address kept)."""
    ray_node.connect(state.address, client_env(state), **init_kwargs)


def read_state(path: Path) -> ClusterState:
    return read_json_file(path, ClusterState, f"no cluster state at {path}: start one with `specfleet cluster up`",
                          "a specfleet cluster state file")


def _write_state(path: Path, state: ClusterState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    tmp.replace(path)


def _is_running(pid: int, create_time: float) -> bool:
    """Whether process `pid`, started at `create_time`, still runs (a zombie does not)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == create_time and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports the OS calls free right now (bound together, then released)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]


def _free_range(width: int, taken: set[int]) -> int:
    """The first port of `width` consecutive free ports below the ephemeral range, avoiding `taken`."""
    for _ in range(50):
        base = random.randrange(10000 // width, (32768 - width) // width) * width  # Linux ephemeral ports: 32768+
        ports = range(base, base + width)
        if taken.isdisjoint(ports):
            try:
                with ExitStack() as stack:
                    for port in ports:
                        stack.enter_context(socket.socket()).bind(("", port))
                return base
            except OSError:
                continue
    raise ClusterError(f"found no {width} consecutive free ports for Ray workers")


def _allocate_ports(num_nodes: int) -> list[dict[str, int]]:
    """Private ports for each node (the head gets the GCS, dashboard and client-server ports too)."""
    names = [list(_HEAD_PORTS + _NODE_PORTS)] + [list(_NODE_PORTS)] * (num_nodes - 1)
    flat = iter(_free_ports(sum(len(n) for n in names)))
    allocated = [{name: next(flat) for name in node} for node in names]
    taken = {p for node in allocated for p in node.values()} | RAY_DEFAULT_PORTS
    for node in allocated:
        node["min_worker"] = _free_range(WORKER_PORTS, taken)
        node["max_worker"] = node["min_worker"] + WORKER_PORTS - 1
        taken.update(range(node["min_worker"], node["max_worker"] + 1))
    return allocated


def ray_start_command(node: NodeSpec | None, head_address: str | None, ports: dict[str, int], temp_dir: str,
                      num_cpus: int, object_store_mb: int, host: str = "127.0.0.1",
                      client_server: bool = False) -> list[str]:
    """`ray start --block` for one node, every port bound to `host`: the head if `head_address` is None (dashboard
    off; the Ray client server only with `client_server`), else a worker joining it (deploy/infra/ray_node.py).
    `node` None: a node outside the inventory (no accelerator labels or pins: nothing is planned there), named
    "head". `host` is also the address the node announces and is reached at (a node in a network namespace of
    its own has its own, deploy/infra/netns.py)."""
    if head_address is None:
        role = ["--head", f"--port={ports['gcs']}", f"--dashboard-port={ports['dashboard']}",
                "--include-dashboard=false"]
        role += [f"--ray-client-server-port={ports['ray_client_server']}"] if client_server else []
    else:
        role = [f"--address={head_address}"]
    flags = {name: ports[name] for name in _NODE_PORTS + ("min_worker", "max_worker")}
    if node is None:
        identity = ["--node-name=head", f"--labels={json.dumps({LABEL_PREFIX + 'role': 'head'})}"]
    else:
        identity = [f"--node-name={node.name}", f"--resources={json.dumps(ray_resources(node))}",
                    f"--labels={json.dumps(ray_labels(node))}"]
    return [
        sys.executable, "-m", "deploy.infra.ray_node", *(["--client-server"] if client_server else []),
        "start", "--block", *role, f"--node-ip-address={host}", f"--temp-dir={temp_dir}",
        *(f"--{name.replace('_', '-')}-port={port}" for name, port in flags.items()),
        "--disable-usage-stats", f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_mb * 2**20}", *identity,
    ]


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _death_signal() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when its parent dies (Linux prctl PR_SET_PDEATHSIG).

    libc is loaded here, in the parent, so that the child does as little as possible between fork and exec.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_death_signal() -> None:
        if prctl(1, signal.SIGTERM) != 0:  # 1: PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    return set_death_signal


def _start_node(node: NodeProcess, command: list[str], env: dict[str, str], die_with_parent: bool) -> NodeProcess:
    Path(node.temp_dir).mkdir(parents=True)
    with node.log.open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_death_signal() if die_with_parent else None)
    return node.model_copy(update={"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time()})


def _check_running(nodes: list[NodeProcess]) -> None:
    for node in nodes:
        if not _is_running(node.pid, node.create_time):
            raise ClusterError(
                f"node {node.spec.name}: `ray start` exited; its log ({node.log}) ends:\n{_tail(node.log)}")


def _wait_for_port(host: str, port: int, nodes: list[NodeProcess], deadline: float) -> None:
    while True:
        _check_running(nodes)
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise ClusterError(f"the head's GCS did not listen on port {port} in time; log:\n{_tail(nodes[0].log)}")
        time.sleep(0.2)


def query_nodes(address: str, expect: int = 0, timeout_s: float = 60.0,
                watch: list[NodeProcess] | None = None, auth_token_path: str | None = None) -> list[LiveNode]:
    """The cluster's nodes from its GCS, once at least `expect` are alive (a child process connects, so the
    caller's own Ray connection, if any, is untouched). ClusterError on timeout or if a `watch` node dies."""
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        if s.connect_ex((host, int(port))) != 0:
            raise ClusterError(f"nothing listens at {address}: the cluster's head is down")
    with tempfile.TemporaryFile("w+") as err:
        probe = subprocess.Popen([sys.executable, "-m", "deploy.infra.local_cluster", address, str(expect), str(timeout_s)],
                                 env=ray_env(auth_token_path=auth_token_path), stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + timeout_s + 30  # the probe's own connect and import time
        try:
            while probe.poll() is None:
                _check_running(watch or [])
                if time.monotonic() > deadline:
                    raise ClusterError(f"no answer from the cluster at {address} within {timeout_s:.0f}s")
                time.sleep(0.2)
        finally:
            if probe.poll() is None:
                probe.kill()
            out = probe.communicate()[0]
        if probe.returncode != 0:
            err.seek(0)
            raise ClusterError(f"could not query the cluster at {address}:\n{err.read()[-2000:]}")
    nodes = [LiveNode.model_validate(n) for n in json.loads(out.strip().splitlines()[-1])]
    if sum(n.alive for n in nodes) < expect:
        raise ClusterError(f"only {sum(n.alive for n in nodes)} of {expect} nodes came up within {timeout_s:.0f}s")
    return nodes


def up(inventory: Inventory, state_path: Path = DEFAULT_STATE, *, num_cpus: int = 4, object_store_mb: int = 256,
       timeout_s: float = 120.0, die_with_parent: bool = False, host: str = "127.0.0.1", client_server: bool = False,
       auth: str = "auto") -> ClusterState:
    """Start one Ray node per inventory node (the first is the head), bound to `host`; return once all are alive.

    `auth`: "token" (Ray token auth) or "auto" (the same), or "disabled" (no token: anyone who reaches `host`,
    another local user on loopback included, can run code in the cluster; for debugging only, and said so).

    If anything fails, every process started so far is stopped and the temp folder removed before the error
    propagates. The state file is written as soon as every process is launched, so `down` can clean up even
    after an interrupted `up`. `die_with_parent` (Linux; for test fixtures) stops the nodes when the calling
    thread's process dies; by default the cluster outlives it, as `specfleet cluster up` needs.
    """
    if auth not in ("auto", "token", "disabled"):
        raise UsageError(f"auth must be auto, token or disabled, not {auth!r}")
    if state_path.exists():
        old = read_state(state_path)
        if running_processes(old):
            raise UsageError(f"a cluster is already up (state {state_path}): stop it with `specfleet cluster down`, "
                             f"or pass another --state")
        stop(old)  # a stale record: nothing runs, only its temp folder is left to remove
    cluster_id = uuid.uuid4().hex[:12]
    root = make_temp_root()
    token = None
    if auth == "disabled":
        log.warning("Ray token auth is off (--auth disabled): anyone who reaches %s can run code in the cluster", host)
    else:
        token = str(ray_node.new_token(Path(root) / "ray-auth-token"))
    env = ray_env(cluster_id, token)
    ports = _allocate_ports(len(inventory.nodes))
    address = f"{host}:{ports[0]['gcs']}"
    started: list[NodeProcess] = []
    state = ClusterState(cluster_id=cluster_id, address=address, temp_dir=root, nodes=[], auth_token_path=token)
    deadline = time.monotonic() + timeout_s
    try:
        for i, spec in enumerate(inventory.nodes):
            node = NodeProcess(spec=spec, head=i == 0, pid=0, create_time=0.0, temp_dir=f"{root}/{i}", ports=ports[i])
            command = ray_start_command(spec, None if i == 0 else address, ports[i], node.temp_dir, num_cpus,
                                        object_store_mb, host, client_server)
            started.append(_start_node(node, command, env, die_with_parent))
            if i == 0:  # workers join once the head's GCS listens
                _wait_for_port(host, ports[0]["gcs"], started, deadline)
        state = state.model_copy(update={"nodes": started})
        _write_state(state_path, state)
        query_nodes(address, expect=len(started), timeout_s=max(1.0, deadline - time.monotonic()), watch=started,
                    auth_token_path=token)
    except BaseException:
        stop(state.model_copy(update={"nodes": started}))
        state_path.unlink(missing_ok=True)
        raise
    return state


def make_temp_root() -> str:
    """A cluster's temp folder, /tmp/sf-*: short, as Ray's socket paths must stay under ~107 characters."""
    return tempfile.mkdtemp(prefix="sf-", dir="/tmp")


def node_processes(state: ClusterState, node: NodeProcess) -> list[psutil.Process]:
    """The live processes of one node of the cluster: its `ray start` and everything under it (raylet, agents, the
    node's Ray workers), for killing one node alone (fault tests)."""
    if not _is_running(node.pid, node.create_time):
        return []
    try:
        leader = psutil.Process(node.pid)
        return [leader, *leader.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pin_nodes(state: ClusterState) -> dict[str, int]:
    """Pin each node's processes to a core of its own (node i to core i modulo the cores), as separate hosts would
    have: what a node starts later (its Ray workers, forked by its raylet) inherits the pin. For benchmarks whose
    instances must not share cores (`bench elastic --pin-cores`); returns node name -> core."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = {}
    for i, node in enumerate(state.nodes):
        core = cores[i % len(cores)]
        for proc in node_processes(state, node):
            try:
                proc.cpu_affinity([core])
            except psutil.NoSuchProcess:  # exited since the listing: nothing to pin
                pass
        pinned[node.spec.name] = core
    return pinned


def stop(state: ClusterState, grace_s: float = 10.0) -> None:
    """Stop the cluster's processes: SIGTERM to each node's process group, SIGKILL to what is left of it after
    `grace_s`, and remove its temp folder. ClusterError if a process survives."""
    for node in state.nodes:
        if _is_running(node.pid, node.create_time):
            try:
                os.killpg(node.pid, signal.SIGTERM)  # the `ray start` process leads its own group (a new session)
            except ProcessLookupError:  # it exited since the check: nothing left to signal
                pass
    if not _wait_gone(state, grace_s):
        for proc in running_processes(state):
            proc.kill()
        left = running_processes(state) if not _wait_gone(state, 5.0) else []
        if left:
            raise ClusterError(f"processes of cluster {state.cluster_id} survived SIGKILL: {[p.pid for p in left]}")
    _reap(state)
    root = Path(state.temp_dir)
    if root.exists():
        if root.parent != Path("/tmp") or not root.name.startswith("sf-"):
            raise ClusterError(f"refusing to remove {root}: not a temp folder that `up` creates (/tmp/sf-*)")
        shutil.rmtree(root)


def running_processes(state: ClusterState) -> list[psutil.Process]:
    """Every live process of the cluster: those in a session that a node's `ray start` leads, and those carrying
    the cluster's MARKER (Ray workers, which leave the session's process group; not agents, whose retitling
    hides their environment).

    A session counts while its leader is the recorded process, or is gone with no process reusing its pid.
    """
    _reap(state)
    sessions = {n.pid for n in state.nodes if _is_running(n.pid, n.create_time) or not psutil.pid_exists(n.pid)}
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        # environ is None where it cannot be read (another user's process): never one this user started
        if (proc.info["environ"] or {}).get(MARKER) == state.cluster_id:
            found.append(proc)
            continue
        try:
            if os.getsid(proc.pid) in sessions:
                found.append(proc)
        except (ProcessLookupError, PermissionError):  # exited since the listing, or not visible to us: not ours
            pass
    return found


def _wait_gone(state: ClusterState, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while running_processes(state):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _reap(state: ClusterState) -> None:
    """Collect the exit status of leaders that are this process's children (when `up` ran in this process)."""
    for node in state.nodes:
        try:
            os.waitpid(node.pid, os.WNOHANG)
        except ChildProcessError:  # not our child, or already collected: nothing to reap
            pass


def down(state_path: Path = DEFAULT_STATE) -> ClusterState:
    """Stop the cluster recorded at `state_path` and remove the file; UsageError if there is none."""
    state = read_state(state_path)
    stop(state)
    state_path.unlink()
    return state


def _probe(address: str, expect: int, timeout_s: float) -> None:
    """Child-process side of query_nodes: connect, wait for `expect` live nodes, print them as JSON."""
    import ray  # only this child process connects to the cluster

    ray_node.keep_address()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = [LiveNode(node_id=n["NodeID"], alive=n["Alive"], labels=n.get("Labels", {}),
                          resources=n["Resources"]) for n in ray.nodes()]
        if sum(n.alive for n in nodes) >= expect or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    ray.shutdown()
    print(json.dumps([n.model_dump() for n in nodes]))


if __name__ == "__main__":
    _probe(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
