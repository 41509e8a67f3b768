"""The container images' entrypoint: a one-node cluster on loopback, the app on every interface (HTTP, gRPC only).

    docker run -p 8000:8000 -p 9000:9000 [-v KEYS:/etc/specfleet/keys:ro] IMAGE [--config FILE ...]

runs `python -m deploy.infra.container`, which:

- takes the API and admin keys from `--keys` (default $SPECFLEET_KEYS_DIR, else /etc/specfleet/keys): the files
  `api-keys` and `admin-keys`, one key a line, as the Kubernetes Secret `specfleet-api-keys` is mounted; a file
  that is missing is created with one random key (mode 600; a read-only mount without them is an error), and the
  config's `serve.auth.*_keys_file` are pointed at them. A key file others may read is refused by the app;
- starts one Ray node on 127.0.0.1 (`specfleet cluster up`'s code: token auth, no dashboard, no client server),
  so Ray's GCS, raylet, object manager and workers are not reachable from outside the container;
- deploys the app with its HTTP and gRPC servers on 0.0.0.0 (`serve.http_port`, `serve.grpc_port`, or the
  `--http-port` / `--grpc-port` flags): the only ports the image exposes;
- prints where it serves and where the keys are, then waits; SIGTERM or SIGINT (`docker stop`) stops the cluster.

KubeRay does not use this: its pods run `ray start` and get the app through serveConfigV2 (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from cluster.config import SpecfleetConfig, load_config
from deploy import DEFAULT_CONFIG, DEFAULT_INVENTORY
from deploy.cli.flags import UsageError
from deploy.cli.serve_cmd import deploy, ensure_key_files, with_ports
from deploy.infra import local_cluster
from deploy.infra.local_cluster import ClusterError
from placement.inventory import load_inventory

KEYS_DIR = Path(os.environ.get("SPECFLEET_KEYS_DIR") or "/etc/specfleet/keys")
KEY_FILES = {"api": "api-keys", "admin": "admin-keys"}  # the names of the Kubernetes Secret's keys
STATE = Path.home() / ".cache" / "specfleet" / "container-cluster.json"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.infra.container", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"app config (default: {DEFAULT_CONFIG})")
    p.add_argument("--keys", type=Path, default=KEYS_DIR,
                   help=f"folder of the key files api-keys and admin-keys, created if missing (default: {KEYS_DIR})")
    p.add_argument("--state", type=Path, default=STATE, help=f"the cluster's state file (default: {STATE})")
    p.add_argument("--http-port", type=int, help="override serve.http_port")
    p.add_argument("--grpc-port", type=int, help="override serve.grpc_port")
    p.add_argument("--num-cpus", type=int, default=max(4, os.cpu_count() or 1),
                   help="CPUs the node offers to Ray (default: this machine's, at least 4)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the app to be running")
    return p


def with_keys(cfg: SpecfleetConfig, folder: Path) -> tuple[SpecfleetConfig, dict[str, Path]]:
    """The config with its key files in `folder` (created there if missing); the files by kind."""
    auth = cfg.serve.auth.model_copy(update={"api_keys_file": str(folder / KEY_FILES["api"]),
                                             "admin_keys_file": str(folder / KEY_FILES["admin"])})
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"auth": auth})})
    try:
        return cfg, ensure_key_files(cfg)
    except OSError as e:
        raise UsageError(f"{folder} lacks the key files {sorted(KEY_FILES.values())} and they cannot be created "
                         f"there ({e.strerror}): mount a folder that has them, or a writable one") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, keys = with_keys(load_config(args.config), args.keys.expanduser())
    except UsageError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_stop() -> None:  # again after the deploy: Ray's driver put its own handlers in place
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    on_stop()
    cfg = with_ports(cfg, args.http_port, args.grpc_port, host="0.0.0.0")
    try:
        state = local_cluster.up(load_inventory(DEFAULT_INVENTORY).first(1), args.state, num_cpus=args.num_cpus,
                                 host="127.0.0.1", die_with_parent=True)
    except ClusterError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 1
    try:
        url = deploy(cfg, state.address, args.timeout, local_cluster.client_env(state))
        on_stop()
        print(f"specfleet is serving {cfg.engine.model.served_name!r} on 0.0.0.0:{cfg.serve.http_port} (HTTP, here "
              f"{url}) and 0.0.0.0:{cfg.serve.grpc_port} (gRPC); API keys in {keys['api']}, admin keys in "
              f"{keys['admin']}; Ray itself listens on 127.0.0.1 only", flush=True)
        while not stop.wait(1.0):
            pass
    except UsageError as e:  # the app did not deploy: said, and the cluster stopped
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 1
    finally:
        local_cluster.down(args.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
