"""`specfleet serve`: deploy the Serve application onto a running cluster and print how to reach it.

    specfleet cluster up && specfleet serve --config deploy/configs/default.yaml

It connects to the local cluster recorded in `--state` (or any Ray cluster with `--address`), starts Ray Serve
with its HTTP proxy on the head node and the gRPC proxy beside it, deploys `deploy.app:build_app`, waits for
every instance to load, and returns; the application keeps running. Key files named by the config that do not
exist yet are created with a random key (mode 600), so a fresh machine gets a working key at a known place.
Its servers listen on `serve.http_host` (`--host`): 127.0.0.1 unless asked (deploy/serve/serve_env.py).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path

from cluster.config import SpecfleetConfig, load_config
from deploy import DEFAULT_CONFIG
from deploy.infra import local_cluster, ray_node
from deploy.cli.flags import UsageError
from deploy.rpc import codegen



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"app config (default: {DEFAULT_CONFIG})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE,
                       help="the local cluster's state file (from `specfleet cluster up`)")
    where.add_argument("--address", help="a Ray cluster's GCS address instead of the local cluster")
    p.add_argument("--host", help="override serve.http_host: where HTTP and gRPC listen (default 127.0.0.1, this "
                                  "machine only; 0.0.0.0 exposes the app, behind its API keys)")
    p.add_argument("--http-port", type=int, help="override serve.http_port")
    p.add_argument("--grpc-port", type=int, help="override serve.grpc_port")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the app to be running")
    p.add_argument("--try", dest="try_prompt", metavar="PROMPT",
                   help="once deployed, send this prompt to /v1/chat/completions and print the reply")
    p.set_defaults(run=run)


def ensure_key_files(cfg: SpecfleetConfig) -> dict[str, Path]:
    """Create missing key files named by the config with one random key each; returns {"api"|"admin": path}."""
    out = {}
    for kind, name in (("api", cfg.serve.auth.api_keys_file), ("admin", cfg.serve.auth.admin_keys_file)):
        if not name:
            continue
        path = Path(name).expanduser()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"sk-specfleet-{secrets.token_urlsafe(24)}\n")
        out[kind] = path
    return out


def with_ports(cfg: SpecfleetConfig, http_port: int | None, grpc_port: int | None,
               host: str | None = None) -> SpecfleetConfig:
    changes = (("http_port", http_port), ("grpc_port", grpc_port), ("http_host", host))
    serve_cfg = cfg.serve.model_copy(update={k: v for k, v in changes if v is not None})
    return cfg.model_copy(update={"serve": serve_cfg})


def deploy(cfg: SpecfleetConfig, address: str, timeout_s: float = 900.0, env: dict[str, str] | None = None) -> str:
    """Start Serve on the cluster at `address` (clients' environment `env`: local_cluster.client_env) and deploy
    the app; returns the HTTP base URL."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deploy.app import APP_NAME, build_app
    from deploy.serve import serve_env

    codegen.ensure()
    # exposed on a cluster on loopback (a container's, a local one): the replicas' servers stay on loopback
    gcs_host = address.rpartition(":")[0].strip("[]")
    replica_host = gcs_host if ray_node.is_loopback(gcs_host) else None
    ray_node.connect(address, env or {}, namespace="specfleet", log_to_driver=False, logging_level="ERROR",
                     runtime_env=serve_env.runtime_env(cfg.serve, replica_host))
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": cfg.serve.http_host, "port": cfg.serve.http_port},
                    grpc_options=gRPCOptions(port=cfg.serve.grpc_port,
                                             grpc_servicer_functions=[codegen.SERVICER_FUNCTION]))
        t0 = time.monotonic()
        serve.run(build_app({"config": cfg}), name=APP_NAME, route_prefix="/", blocking=False)
        _wait_running(APP_NAME, t0 + timeout_s)
    finally:
        import ray

        ray.shutdown()
    host = "127.0.0.1" if cfg.serve.http_host in ("0.0.0.0", "::") else cfg.serve.http_host
    return f"http://{host}:{cfg.serve.http_port}"


def _wait_running(app: str, deadline: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise UsageError(f"the application failed to deploy: {status.message}")
        if time.monotonic() > deadline:
            raise UsageError(f"the application is not running after the timeout: {status.status if status else None}")
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    cfg = with_ports(load_config(args.config), args.http_port, args.grpc_port, args.host)
    if args.address:
        address, env = args.address, {}
    else:
        state = local_cluster.read_state(args.state)
        address, env = state.address, local_cluster.client_env(state)
    keys = ensure_key_files(cfg)
    url = deploy(cfg, address, args.timeout, env)
    model = cfg.engine.model.served_name
    key_ref = f"$(cat {keys['api']})" if "api" in keys else f"${cfg.serve.auth.api_keys_env}"
    print(f"specfleet is serving {model!r} at {url} (gRPC on port {cfg.serve.grpc_port})")
    if ray_node.is_loopback(cfg.serve.http_host):
        print(f"it listens on {cfg.serve.http_host} only (this machine); to expose it, behind its API keys: "
              f"specfleet serve --host 0.0.0.0 (or serve.http_host in the config), on a fresh `specfleet cluster up`")
    print(f"API key: {keys.get('api', '$' + cfg.serve.auth.api_keys_env)}; "
          f"admin key: {keys.get('admin', '$' + cfg.serve.auth.admin_keys_env)}")
    print("try:\n"
          f"  curl {url}/v1/chat/completions -H \"Authorization: Bearer {key_ref}\" -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          f"\"max_tokens\": 32}}'")
    sys.stdout.flush()
    if args.try_prompt and "api" in keys:
        return try_request(url, keys["api"].read_text().split()[0], model, args.try_prompt)
    return 0


def try_request(url: str, key: str, model: str, prompt: str) -> int:
    """One chat completion through the HTTP endpoint; prints the reply and its speculation figures."""
    import httpx

    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
                         "temperature": 0})
    if r.status_code != 200:
        print(f"the test request failed: HTTP {r.status_code}: {r.text}", file=sys.stderr)
        return 1
    body = r.json()
    spec = body["spec_decode"]
    print(f"\n> {prompt}\n{body['choices'][0]['message']['content']}\n"
          f"[{body['usage']['completion_tokens']} tokens; {spec['accepted_tokens']}/{spec['proposed_tokens']} drafts "
          f"accepted, {spec['mean_accepted_length']:.2f} tokens per verification]")
    return 0
