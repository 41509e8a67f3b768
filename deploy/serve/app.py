"""The Ray Serve application: `deploy.app:build_app` (what `serve run`, `serve deploy` and KubeRay's serveConfigV2 name).

The fleet is planned once, here (deploy/serve/fleet.py): one `SpecfleetInstance` deployment per planned instance
(one replica: it starts the InstanceServer actor its InstanceSpec describes, registers it with the router and
reports its health to Serve, which replaces it, in the same place, if it fails), and
`SpecfleetAPI`, the ingress: OpenAI-compatible HTTP (deploy/serve/http_api.py) and the gRPC service
(deploy/rpc/specfleet.proto, deploy/serve/grpc_api.py), both over one Frontend (deploy/serve/frontend.py).

    args = {"config": {...SpecfleetConfig...}}   or   {"config_path": "deploy/configs/default.yaml"}
"""


import logging
from pathlib import Path

import ray
from ray import serve
from fastapi import Request, Response
from ray.serve.handle import DeploymentHandle

from actors.instance_server import InstanceServer
from cluster.config import ConfigError, RouterConfig, SpecfleetConfig, load_config, parse_config
from cluster.router import find_router, get_or_create_router
from deploy import DEFAULT_CONFIG
from deploy.rpc import codegen
from deploy.serve.fleet import fleet_specs
from placement.fleet import InstanceSpec

codegen.ensure()  # the gRPC modules, before deploy.serve.grpc_api imports them

from deploy.serve.grpc_api import GrpcMethods  # noqa: E402
from deploy.serve.http_api import http_app, HttpRoutes  # noqa: E402

log = logging.getLogger(__name__)
APP_NAME = "specfleet"


def config_from_args(args: dict) -> SpecfleetConfig:
    """The app's config from Serve's args: an inline `config` mapping or a `config_path` (default: the embedded one)."""
    unknown = set(args) - {"config", "config_path"}
    if unknown:
        raise ConfigError(f"unknown application args {sorted(unknown)}; give `config` (a mapping) or `config_path`")
    if "config" in args and "config_path" in args:
        raise ConfigError("give either `config` or `config_path`, not both")
    if "config" in args:
        cfg = args["config"]
        return cfg if isinstance(cfg, SpecfleetConfig) else parse_config(cfg, source="application args: config")
    return load_config(args.get("config_path") or DEFAULT_CONFIG)


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=2.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class SpecfleetInstance:
    """One planned engine instance: owns its InstanceServer actor and keeps it registered with the router."""

    def __init__(self, spec: InstanceSpec, router_cfg: RouterConfig) -> None:
        self.spec = spec
        self.instance_id = spec.instance_id
        pin = InstanceServer.pin(spec)
        self.server = InstanceServer.spawn(spec, resources={**pin, **router_cfg.instance_resources})
        self.info = ray.get(self.server.info.remote(), timeout=900)  # models load here
        self.router = get_or_create_router(router_cfg)
        self._register()

    def _register(self) -> None:
        i = self.info
        ray.get(self.router.register.remote(self.instance_id, self.server, i.model, i.max_model_len, i.node_id,
                                            self.spec.place), timeout=30)

    async def check_health(self) -> None:
        """Serve calls this every few seconds; raising makes Serve replace the replica (and so the instance)."""
        health = await self.server.health.remote()
        if not health.healthy:
            raise RuntimeError(f"instance {self.instance_id} is unhealthy: {health.error}")
        if not await self.router.is_registered.remote(self.instance_id):  # the router restarted, or removed us
            await self.router.register.remote(self.instance_id, self.server, self.info.model,
                                              self.info.max_model_len, self.info.node_id, self.spec.place)

    async def instance_id_(self) -> str:
        return self.instance_id

    def __del__(self) -> None:
        try:
            self.router.deregister.remote(self.instance_id)
            ray.kill(self.server, no_restart=True)
        except Exception:  # noqa: BLE001 - best effort at teardown; the router also drops instances that vanish
            log.warning("could not deregister instance %s at shutdown", getattr(self, "instance_id", "?"))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(http_app)
class SpecfleetAPI(HttpRoutes, GrpcMethods):
    """The ingress: HTTP routes (FastAPI) and gRPC methods over one Frontend."""

    def __init__(self, cfg: SpecfleetConfig, instances: list[DeploymentHandle]) -> None:
        from deploy.model_store import resolve_model
        from deploy.serve.auth import KeySet
        from deploy.serve.edge import Edge
        from deploy.serve.frontend import Frontend

        self.cfg = cfg
        self.instances = instances  # keeps the instance deployments part of the app
        self.router = get_or_create_router(cfg.router)
        ray.get(self.router.configure.remote(cfg.router), timeout=30)
        self.frontend = Frontend(cfg, self.router, resolve=lambda s: resolve_model(s, cfg.engine.model.dtype))
        self.edge = Edge(cfg.serve, self.frontend)
        self.api_keys = KeySet.load(cfg.serve.auth)
        self.admin_keys = KeySet.load(cfg.serve.auth, admin=True)
        log.info("API keys: %d for /v1 and gRPC, %d for /admin (from %s)", len(self.api_keys), len(self.admin_keys),
                 self.api_keys.source)

    # The routes are declared here, in the ingress class itself (Serve's class-based views need that);
    # their bodies are in deploy/serve/http_api.py.
    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._models(request)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._completions(request)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._chat_completions(request)

    @http_app.get("/health")
    async def health(self) -> Response:
        return await self._health()

    @http_app.get("/metrics")
    async def metrics(self) -> Response:
        return await self._metrics()

    @http_app.get("/admin/instances")
    async def admin_instances(self, request: Request) -> Response:
        return await self._admin_instances(request)

    @http_app.get("/admin/migrations")
    async def admin_migrations(self, request: Request) -> Response:
        return await self._admin_migrations(request)

    @http_app.get("/admin/requests")
    async def admin_requests(self, request: Request) -> Response:
        return await self._admin_requests(request)

    @http_app.post("/admin/requests/{request_id}/abort")
    async def admin_abort(self, request_id: str, request: Request) -> Response:
        return await self._admin_abort(request_id, request)

    @http_app.post("/admin/requests/{request_id}/migrate")
    async def admin_migrate(self, request_id: str, request: Request) -> Response:
        return await self._admin_migrate(request_id, request)

    @http_app.post("/admin/instances/{instance_id}/drain")
    async def admin_drain(self, instance_id: str, request: Request) -> Response:
        return await self._admin_drain(instance_id, request)

    @http_app.get("/admin/instances/{instance_id}/routing")
    async def admin_routing(self, instance_id: str, request: Request) -> Response:
        return await self._admin_routing(instance_id, request)

    @http_app.post("/admin/instances/{instance_id}/undrain")
    async def admin_undrain(self, instance_id: str, request: Request) -> Response:
        return await self._admin_undrain(instance_id, request)


def build_app(args: dict) -> serve.Application:
    """Serve's application builder: the instance deployment (one replica per instance) and the API in front."""
    cfg = config_from_args(args or {})
    specs = fleet_specs(cfg)  # the fleet, planned once (deploy/serve/fleet.py)
    instances = [SpecfleetInstance.options(name=f"SpecfleetInstance-{s.instance_id}", num_replicas=1).bind(s, cfg.router)
                 for s in specs]
    api = SpecfleetAPI.options(ray_actor_options={"num_cpus": 0, "resources": dict(cfg.serve.api_resources)})
    return api.bind(cfg, instances)


__all__ = ["build_app", "find_router", "APP_NAME"]
