"""`specfleet cluster up|status|down`: a local multi-node Ray cluster from a node inventory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deploy import DEFAULT_INVENTORY
from deploy.infra import local_cluster
from deploy.cli.flags import UsageError
from deploy.infra.local_cluster import ClusterError, ClusterState, LiveNode
from placement.inventory import NODE_RESOURCE, load_inventory


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    up = actions.add_parser("up", help="start a head and N-1 worker nodes (raylets) on this machine")
    up.add_argument("--nodes", type=int, metavar="N",
                    help="how many nodes: the first N of the inventory (default: all of it)")
    up.add_argument("--node-labels", "--inventory", dest="inventory", type=Path, metavar="FILE",
                    default=DEFAULT_INVENTORY,
                    help="node inventory YAML, whose nodes give each Ray node its labels and resources "
                         "(default: deploy/configs/fleet.yaml)")
    up.add_argument("--num-cpus", type=int, default=4, help="CPUs each node offers to Ray (simulated; default 4)")
    up.add_argument("--object-store-mb", type=int, default=256, help="object store per node, MiB (default 256)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every node to be alive")
    up.add_argument("--host", default="127.0.0.1",
                    help="the address every node's ports are bound to (default 127.0.0.1: this machine only); "
                         "Ray token auth is on either way (see --auth)")
    up.add_argument("--auth", choices=["auto", "token", "disabled"], default="auto",
                    help="Ray token auth: auto or token (on, the default, loopback included), or disabled (anyone "
                         "who reaches --host, another local user included, can run code in the cluster)")
    up.add_argument("--client-server", action="store_true",
                    help="also start Ray's client server on the head (ray://; off by default: it runs code for "
                         "anyone who reaches it)")
    up.set_defaults(run=run_up)

    status = actions.add_parser("status", help="the cluster's nodes, their labels and resources")
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")
    status.set_defaults(run=run_status)

    down = actions.add_parser("down", help="stop exactly the processes `up` started (never `ray stop`)")
    down.set_defaults(run=run_down)

    for action in (up, status, down):
        action.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE,
                            help=f"the cluster's state file (default: {local_cluster.DEFAULT_STATE})")


def run_up(args: argparse.Namespace) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {args.nodes}")
    if args.num_cpus < 1 or args.object_store_mb < 80 or args.timeout <= 0:
        raise UsageError("--num-cpus must be >= 1, --object-store-mb >= 80 (Ray's minimum), --timeout > 0")
    inventory = load_inventory(args.inventory)
    if args.nodes is not None:
        if args.nodes > len(inventory.nodes):
            raise UsageError(f"--nodes {args.nodes}: {args.inventory} lists only {len(inventory.nodes)} nodes")
        inventory = inventory.first(args.nodes)
    try:
        state = local_cluster.up(inventory, args.state, num_cpus=args.num_cpus, object_store_mb=args.object_store_mb,
                                 timeout_s=args.timeout, host=args.host, client_server=args.client_server,
                                 auth=args.auth)
    except ClusterError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 1
    print(f"cluster up: {len(state.nodes)} nodes at {state.address} (state {args.state}, logs in {state.temp_dir})")
    for node in state.nodes:
        spec = node.spec
        print(f"  {spec.name:<12} {'head' if node.head else 'worker':<6} {spec.accelerator} x{spec.count}, "
              f"{spec.memory_gb:g} GB, speed {spec.speed:g}, pid {node.pid}")
    if state.auth_token_path:
        print(f"Ray token auth is on; the token is in {state.auth_token_path} (mode 600). A node joining from another "
              f"host: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<a copy of it> ray start --address={state.address}")
    print(f"connect: from deploy.infra.local_cluster import connect, read_state; connect(read_state(PATH)) "
          f"(keeps the address as given; {'token auth' if state.auth_token_path else 'RAY_AUTH_MODE=disabled'}); "
          f"pin work with resources={{\"{NODE_RESOURCE.format(name=state.nodes[0].spec.name)}\": 1}}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    state = local_cluster.read_state(args.state)
    try:
        live = local_cluster.query_nodes(state.address, timeout_s=30.0, auth_token_path=state.auth_token_path)
    except ClusterError as e:
        _print_recorded(state)
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 1
    by_name = {node.name: node for node in live}
    if args.json:
        nodes = [{"name": n.spec.name, "head": n.head, "pid": n.pid,
                  **(by_name[n.spec.name].model_dump() if n.spec.name in by_name else {"alive": False})}
                 for n in state.nodes]
        print(json.dumps({"address": state.address, "temp_dir": state.temp_dir, "nodes": nodes}))
    else:
        print(f"cluster at {state.address} (state {args.state}, logs in {state.temp_dir})")
        for node in state.nodes:
            print(_describe(node.spec.name, node.head, by_name.get(node.spec.name)))
    return 0 if all(n.spec.name in by_name and by_name[n.spec.name].alive for n in state.nodes) else 1


def _describe(name: str, head: bool, live: LiveNode | None) -> str:
    role = "head" if head else "worker"
    if live is None:
        return f"  {name:<12} {role:<6} not registered with the cluster"
    labels = ", ".join(f"{k}={v}" for k, v in sorted(live.labels.items()) if not k.startswith("ray.io/"))
    resources = ", ".join(f"{k}={v:g}" for k, v in sorted(live.resources.items())
                          if k not in ("memory", "object_store_memory") and not k.startswith("node:"))
    return (f"  {name:<12} {role:<6} {'alive' if live.alive else 'DEAD':<5} node {live.node_id[:12]}\n"
            f"      labels: {labels}\n      resources: {resources}")


def _print_recorded(state: ClusterState) -> None:
    running = {p.pid for p in local_cluster.running_processes(state)}
    print(f"cluster at {state.address} as recorded (logs in {state.temp_dir}):")
    for node in state.nodes:
        print(f"  {node.spec.name:<12} pid {node.pid} {'running' if node.pid in running else 'not running'}")


def run_down(args: argparse.Namespace) -> int:
    try:
        state = local_cluster.down(args.state)
    except ClusterError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 1
    print(f"cluster down: stopped the {len(state.nodes)} nodes at {state.address}; removed {args.state}")
    return 0
