"""Ray nodes as separate hosts on one machine: each worker in a Linux network namespace of its own, with its own address.

    fabric = Fabric.create(3)                      # a bridge with 10.a.b.1/24 here, three namespaces at .11-.13
    state = up(inventory, state_path, fabric)      # the head here on the bridge's address, worker i in namespace i
    fabric.cut(1); fabric.restore(1)               # worker 1's link down, then up
    fabric.degrade(2, delay_ms=40, loss_pct=2)     # netem where the kernel has it, else a rate limit and nft loss
    kill_node(state, 1); restart_node(state_path, 1, fabric, readdress=True)   # it comes back at a new address
    local_cluster.down(state_path); fabric.remove()

Every worker reaches the others and the head over a veth pair and the bridge, so Ray's control plane, gloo and the
KV links really cross an interface that a test can cut, slow down or drop packets on. The head stays in this
process's namespace on the bridge's address (a Ray driver needs a raylet of its own address, and the test's driver
runs here). The address range is private (10.0.0.0/8), picked so that it overlaps nothing on this machine, and
everything made (bridge, namespaces, their veths and nft tables) is removed by `remove`, also at this process's exit.

Needs root and iproute2 (`ip`, `tc`); `nft` (nftables) for packet loss where the kernel has no netem qdisc. `probe`
says in one line why namespaces cannot be made here.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from deploy.infra import local_cluster
from deploy.infra.local_cluster import ClusterError, ClusterState, NodeProcess
from placement.inventory import Inventory, NodeSpec

HEAD = NodeSpec(name="head", accelerator="none", count=1, memory_gb=1, speed=1)  # the record of the head node
# faster node-failure detection for fault tests (Ray's defaults take about 30 s): a raylet is given up after 5 missed
# probes of 1 s, each answered within 3 s (tighter, and a loaded 2-core machine lost healthy nodes)
FAST_DETECTION = {"RAY_health_check_initial_delay_ms": "2000", "RAY_health_check_period_ms": "1000",
                  "RAY_health_check_timeout_ms": "3000", "RAY_health_check_failure_threshold": "5"}


class FabricError(RuntimeError):
    """Network namespaces cannot be made here; the message says why in one line."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise FabricError(f"`{' '.join(args)}` failed: {(out.stderr or out.stdout).strip()}")
    return out


def probe() -> str | None:
    """None if namespaces, veths and a bridge can be made here; else why not, in one line."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    tag = uuid.uuid4().hex[:6]
    try:
        _run("ip", "netns", "add", f"sfp{tag}")
        _run("ip", "link", "add", f"sfp{tag}v", "type", "veth", "peer", "name", "eth0", "netns", f"sfp{tag}")
        _run("ip", "link", "add", f"sfp{tag}b", "type", "bridge")
    except FabricError as e:
        return str(e)
    finally:
        _run("ip", "link", "del", f"sfp{tag}b", check=False)
        _run("ip", "netns", "del", f"sfp{tag}", check=False)  # its veth goes with it
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _run("ip", "-j", "-4", "addr").stdout
    return [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for link in json.loads(out) for a in link.get("addr_info", [])]


@dataclass
class Fabric:
    """A bridge in this namespace and one namespace per worker, each joined to the bridge by a veth pair."""

    tag: str
    network: ipaddress.IPv4Network  # a /24; the bridge is .1, worker i .11 + i (+ 100 once readdressed)
    nodes: int
    addresses: dict[int, str] = field(default_factory=dict)
    degraded: dict[int, str] = field(default_factory=dict)

    @classmethod
    def create(cls, nodes: int) -> "Fabric":
        why = probe()
        if why is not None:
            raise FabricError(why)
        used = _used_networks()
        for _ in range(100):
            net = ipaddress.ip_network(f"10.{random.randrange(200, 250)}.{random.randrange(1, 255)}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        else:
            raise FabricError("found no free private /24 for the fabric")
        fabric = cls(uuid.uuid4().hex[:6], net, nodes)
        atexit.register(fabric.remove)
        try:
            _run("ip", "link", "add", fabric.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{fabric.host_ip}/24", "dev", fabric.bridge)
            _run("ip", "link", "set", fabric.bridge, "up")
            for i in range(nodes):
                fabric._add(i)
        except BaseException:
            fabric.remove()
            raise
        return fabric

    @property
    def bridge(self) -> str:
        return f"sf{self.tag}b"

    @property
    def host_ip(self) -> str:
        return str(self.network.network_address + 1)

    def ns(self, i: int) -> str:
        return f"sf{self.tag}n{i}"

    def veth(self, i: int) -> str:
        return f"sf{self.tag}v{i}"

    def ip(self, i: int) -> str:
        return self.addresses[i]

    def _add(self, i: int) -> None:
        ns, veth = self.ns(i), self.veth(i)
        _run("ip", "netns", "add", ns)
        # `ip netns exec` mounts /etc/netns/NS/* over /etc/*: a host of its own resolves its name to its own address,
        # and has no DNS server to wait for (this machine's is out of reach from the namespace: every lookup, e.g.
        # c10d's of a socket's peer, would stall for the resolver's timeout, 10 s)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        self._address(i, str(self.network.network_address + 11 + i))
        _run("ip", "-n", ns, "route", "add", "default", "via", self.host_ip)

    def _address(self, i: int, address: str) -> None:
        old = self.addresses.get(i)
        if old is not None:
            _run("ip", "-n", self.ns(i), "addr", "del", f"{old}/24", "dev", "eth0")
        _run("ip", "-n", self.ns(i), "addr", "add", f"{address}/24", "dev", "eth0")
        self.addresses[i] = address
        (Path("/etc/netns") / self.ns(i) / "hosts").write_text(
            f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")

    def readdress(self, i: int) -> str:
        """Give worker i another address (what a replacement pod gets): .111 + i instead of .11 + i, and back."""
        now = int(ipaddress.ip_address(self.ip(i))) - int(self.network.network_address)
        self._address(i, str(self.network.network_address + (now + 100 if now < 100 else now - 100)))
        _run("ip", "-n", self.ns(i), "route", "replace", "default", "via", self.host_ip)
        return self.ip(i)

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in worker i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    # ---- faults on a worker's link ----------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Worker i's link down: nothing goes in or out (its processes keep running)."""
        _run("ip", "link", "set", self.veth(i), "down")

    def restore(self, i: int) -> None:
        _run("ip", "link", "set", self.veth(i), "up")

    def degrade(self, i: int, delay_ms: float = 40.0, loss_pct: float = 2.0, rate_mbit: float = 20.0) -> str:
        """Worker i's link made slow and lossy both ways; returns what was applied. netem (`delay`, `loss`) where
        the kernel has it; otherwise a token-bucket rate limit (queueing delay under load) and random drops by
        nftables in the namespace (if `nft` is installed)."""
        netem = _run("tc", "qdisc", "add", "dev", self.veth(i), "root", "netem", "delay", f"{delay_ms}ms",
                     "loss", f"{loss_pct}%", check=False)
        if netem.returncode == 0:
            _run("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                 f"{delay_ms}ms", "loss", f"{loss_pct}%")
            self.degraded[i] = f"netem delay {delay_ms:g} ms, loss {loss_pct:g}% each way"
            return self.degraded[i]
        tbf = ("tbf", "rate", f"{rate_mbit}mbit", "burst", "32kbit", "latency", f"{max(50, 10 * delay_ms):g}ms")
        _run("tc", "qdisc", "add", "dev", self.veth(i), "root", *tbf)
        _run("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
        what = f"no netem in this kernel: rate limit {rate_mbit:g} Mbit/s each way"
        if shutil.which("nft") is not None:
            table, nft = f"sf{self.tag}loss", ["ip", "netns", "exec", self.ns(i), "nft"]
            _run(*nft, "add", "table", "inet", table)
            for chain, hook in (("rx", "input"), ("tx", "output")):
                _run(*nft, "add", "chain", "inet", table, chain, f"{{ type filter hook {hook} priority 0; }}")
                _run(*nft, "add", "rule", "inet", table, chain, "numgen", "random", "mod", "1000", "<",
                     str(int(loss_pct * 10)), "drop")
            what += f", random loss {loss_pct:g}% each way (nftables)"
        self.degraded[i] = what
        return what

    def heal(self, i: int) -> None:
        """Undo `degrade`."""
        _run("tc", "qdisc", "del", "dev", self.veth(i), "root", check=False)
        _run("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if shutil.which("nft") is not None:
            _run("ip", "netns", "exec", self.ns(i), "nft", "delete", "table", "inet", f"sf{self.tag}loss", check=False)
        self.degraded.pop(i, None)

    def remove(self) -> None:
        """Delete every namespace (with its veth and tables) and the bridge; idempotent."""
        for i in range(self.nodes):
            _run("ip", "netns", "del", self.ns(i), check=False)
            shutil.rmtree(Path("/etc/netns") / self.ns(i), ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)


# ---- a Ray cluster on the fabric ----------------------------------------------------------------------------
def up(inventory: Inventory, state_path: Path, fabric: Fabric | None, *, num_cpus: int = 4, object_store_mb: int = 256,
       timeout_s: float = 120.0, die_with_parent: bool = True, env: dict[str, str] | None = None) -> ClusterState:
    """The head here at the bridge's address (no inventory labels: nothing is planned on it), then worker i of
    `inventory` in namespace i at its own address; returns once all are alive. Without a fabric every node runs
    here on loopback (where namespaces cannot be made). The state file is the local cluster's
    (deploy/infra/local_cluster.py), so `local_cluster.down` stops it."""
    if fabric is not None and len(inventory.nodes) != fabric.nodes:
        raise ClusterError(f"the fabric has {fabric.nodes} namespaces for {len(inventory.nodes)} workers")
    host = fabric.host_ip if fabric is not None else "127.0.0.1"
    cluster_id = uuid.uuid4().hex[:12]
    root = local_cluster.make_temp_root()
    node_env = {**local_cluster.ray_env(cluster_id), **FAST_DETECTION, **(env or {})}
    ports = local_cluster._allocate_ports(len(inventory.nodes) + 1)
    address = f"{host}:{ports[0]['gcs']}"
    state = ClusterState(cluster_id=cluster_id, address=address, temp_dir=root, nodes=[])
    started: list[NodeProcess] = []
    deadline = time.monotonic() + timeout_s
    try:
        head = NodeProcess(spec=HEAD, head=True, pid=0, create_time=0.0, temp_dir=f"{root}/0", ports=ports[0])
        command = local_cluster.ray_start_command(None, None, ports[0], head.temp_dir, num_cpus, object_store_mb,
                                                  host=host)
        started.append(local_cluster._start_node(head, command, node_env, die_with_parent))
        local_cluster._wait_for_port(host, ports[0]["gcs"], started, deadline)
        for i, spec in enumerate(inventory.nodes):  # one at a time: a loaded machine timed out raylets started at once
            started.append(_start_worker(state, i, spec, ports[i + 1], f"{root}/{i + 1}", fabric, node_env,
                                         num_cpus, object_store_mb, die_with_parent, deadline))
        state = state.model_copy(update={"nodes": started})
        local_cluster._write_state(state_path, state)
        local_cluster.query_nodes(address, expect=len(started), timeout_s=max(1.0, deadline - time.monotonic()),
                                  watch=started)
    except BaseException:
        local_cluster.stop(state.model_copy(update={"nodes": started}))
        state_path.unlink(missing_ok=True)
        raise
    return state


def _start_worker(state: ClusterState, i: int, spec: NodeSpec, ports: dict[str, int], temp_dir: str,
                  fabric: Fabric | None, env: dict[str, str], num_cpus: int, object_store_mb: int,
                  die_with_parent: bool, deadline: float, attempts: int = 3) -> NodeProcess:
    """Start worker i and wait until its `ray start` says the node runs; Ray gives a raylet 30 s to register, which
    a loaded machine sometimes misses: then it is started again (up to `attempts` times)."""
    prefix, ip = (fabric.exec_prefix(i), fabric.ip(i)) if fabric is not None else ([], "127.0.0.1")
    for attempt in range(attempts):
        folder = temp_dir if attempt == 0 else f"{temp_dir}-{attempt}"
        node = NodeProcess(spec=spec, head=False, pid=0, create_time=0.0, temp_dir=folder, ports=ports)
        command = prefix + local_cluster.ray_start_command(spec, state.address, ports, folder, num_cpus,
                                                           object_store_mb, host=ip)
        node = local_cluster._start_node(node, command, env, die_with_parent)
        while local_cluster._is_running(node.pid, node.create_time):
            if "Ray runtime started" in node.log.read_text(errors="replace"):
                return node
            if time.monotonic() > deadline:
                raise ClusterError(f"node {spec.name} did not start in time; its log ({node.log})")
            time.sleep(0.2)
    raise ClusterError(f"node {spec.name}: `ray start` exited {attempts} times; its log ({node.log}) ends:\n"
                       + node.log.read_text(errors="replace")[-1500:])


def kill_node(state: ClusterState, i: int) -> None:
    """SIGKILL worker i's whole node: its `ray start`, raylet and every worker process of it (no goodbye to the
    GCS: it finds the node dead by its health checks)."""
    node = state.nodes[i + 1]
    for proc in local_cluster.node_processes(state, node):
        proc.kill()


def restart_node(state_path: Path, i: int, fabric: Fabric | None, *, readdress: bool = False, num_cpus: int = 4,
                 object_store_mb: int = 256, env: dict[str, str] | None = None,
                 die_with_parent: bool = True) -> ClusterState:
    """Start worker i again (after `kill_node`, or after Ray gave it up during a cut), in its namespace, at a new
    address with `readdress` (a replacement pod); the state file records the new process. Waits until it is alive.
    With `die_with_parent` the node is stopped when the calling *thread* ends (Linux's parent-death signal is
    per thread): call it from a thread that lives as long as the cluster, not an executor's."""
    state = local_cluster.read_state(state_path)
    old = state.nodes[i + 1]
    for proc in local_cluster.node_processes(state, old):  # whatever is left of it
        proc.kill()
    if readdress and fabric is not None:
        fabric.readdress(i)
    temp_dir = f"{old.temp_dir}-r{int(time.time() * 1000) % 100000}"
    node_env = {**local_cluster.ray_env(state.cluster_id), **FAST_DETECTION, **(env or {})}
    ports = local_cluster._allocate_ports(2)[1]  # a worker's set (its namespace has a port space of its own)
    started = _start_worker(state, i, old.spec, ports, temp_dir, fabric, node_env, num_cpus, object_store_mb,
                            die_with_parent, time.monotonic() + 180)
    nodes = list(state.nodes)
    nodes[i + 1] = started
    state = state.model_copy(update={"nodes": nodes})
    local_cluster._write_state(state_path, state)
    alive = sum(1 for n in nodes if local_cluster._is_running(n.pid, n.create_time))
    local_cluster.query_nodes(state.address, expect=alive, timeout_s=60.0, watch=[started])
    return state
