"""What Serve's processes get from the `specfleet serve` driver that starts Serve: where its servers listen, the
gRPC message limit, and the HTTP proxy's middleware.

Serve's HTTP proxy listens on `http_options.host`, but Ray Serve 2.60 has no host for its other servers: the
gRPC proxy listens on `[::]:PORT` and every replica on `[::]:0` (its server for calls between deployments),
every interface both. And the gRPC proxy takes messages of up to 2 GiB unless RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
(read when a proxy's process imports Serve) says otherwise, so a huge message crossed into the replica before
anything refused it. `specfleet serve` starts Serve from a job whose runtime_env (`runtime_env`) carries both:
environment variables, which the Serve controller inherits from the job and the proxies and replicas from the
controller, and `bind_servers` as the worker process setup hook, which makes those servers listen on
`serve.http_host` instead of every interface (it wraps the two functions Serve adds their ports with). The
replicas' servers carry only calls between deployments, never a client's: when the app is exposed (`http_host`
0.0.0.0) on a cluster whose nodes run on loopback (a one-node container, a local cluster), they stay on that
loopback address (`replica_host`), so the app's HTTP and gRPC ports are the only ones open to others. The HTTP
proxy runs `proxy_guard.RefusalMemo` (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): a key refused as a whole is
answered by the proxy until its Retry-After. On Kubernetes pods listen on every interface behind a NetworkPolicy,
and the head's environment carries the message limit and the proxy's middleware (deploy/infra/k8s_render.py).
"""

from __future__ import annotations

import os
import sys

from cluster.config import ServeConfig

BIND_HOST_ENV = "SPECFLEET_BIND_HOST"
REPLICA_HOST_ENV = "SPECFLEET_REPLICA_HOST"  # the replicas' servers' host, when it is not BIND_HOST_ENV's
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # the HTTP proxy's middlewares, read at its start
PROXY_CALLBACK = "deploy.serve.proxy_guard.middlewares"
ALL_INTERFACES = ("0.0.0.0", "::", "[::]", "")


def runtime_env(cfg: ServeConfig, replica_host: str | None = None) -> dict:
    """The runtime_env of the job that starts Serve; `replica_host`: where the replicas' servers listen, if not on
    `cfg.http_host`."""
    env = {BIND_HOST_ENV: cfg.http_host, GRPC_MAX_MESSAGE_ENV: str(cfg.max_request_bytes),
           PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    if replica_host is not None and replica_host != cfg.http_host:
        env[REPLICA_HOST_ENV] = replica_host
    return {"worker_process_setup_hook": f"{__name__}.bind_servers", "env_vars": env}


def on_host(address: str, host: str) -> str:
    """`address` (HOST:PORT) moved to `host` if it names every interface; otherwise unchanged."""
    bound, _, port = address.rpartition(":")
    if bound not in ALL_INTERFACES:
        return address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_servers() -> None:
    """Worker setup hook: Serve's gRPC proxy in this process listens on $SPECFLEET_BIND_HOST only, its replicas'
    servers on $SPECFLEET_REPLICA_HOST (default: the same)."""
    host = os.environ.get(BIND_HOST_ENV, "")
    replica = os.environ.get(REPLICA_HOST_ENV) or host
    from ray._common import tls_utils
    from ray.serve._private import default_impl

    if replica not in ALL_INTERFACES:
        add_port = tls_utils.add_port_to_grpc_server  # replicas' server, imported by name into Serve's replica module
        for module in (tls_utils, sys.modules.get("ray.serve._private.replica")):  # (loaded already, or later)
            if module is not None:
                module.add_port_to_grpc_server = lambda server, address: add_port(server, on_host(address, replica))
    if host not in ALL_INTERFACES:
        default_impl.add_grpc_address = lambda server, address: server.add_insecure_port(on_host(address, host))
