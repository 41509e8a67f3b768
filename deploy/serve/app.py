"""The Ray Serve application: `deploy.app:build_app` (what `serve run`, `serve deploy` and KubeRay's serveConfigV2 name).

The fleet is planned once, here (deploy/serve/fleet.py): one `SpecfleetInstance` deployment per planned instance
(one replica: it starts the InstanceServer actor its InstanceSpec describes, registers it with the router and
reports its health to Serve, which replaces it if it fails: in the same place, or, if that place's node is gone
or its devices taken, in a place planned again over the nodes alive then), and
`SpecfleetAPI`, the ingress: OpenAI-compatible HTTP (APIRouters in deploy/serve/http_app.py) and the gRPC service
(deploy/rpc/specfleet.proto, deploy/serve/grpc_api.py), both over one ApiContext (deploy/serve/api_context.py) whose
Frontend (deploy/serve/frontend.py) gets its own FrontendConfig (deploy/serve/frontend_config.py).

    args = {"config": {...SpecfleetConfig...}}   or   {"config_path": "deploy/configs/default.yaml"}
"""


import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import ray
from ray import serve
from fastapi import FastAPI
from ray.serve.handle import DeploymentHandle

from actors.serving.server import InstanceServer
from cluster.config import ConfigError, FleetConfig, RouterConfig, SpecfleetConfig, load_config, parse_config
from cluster.router import INSTANCE_ACTOR_PREFIX, NAMESPACE, find_router, get_or_create_router
from cluster.router_client import RouterClient
from deploy import DEFAULT_CONFIG
from deploy.rpc import codegen
from deploy.serve.autoscaler import SpecfleetAutoscaler
from deploy.serve.fleet import fleet_specs, live_nodes, replan
from deploy.serve.ttft_reporter import TtftReporter
from placement.fleet import InstanceSpec
from placement.planner import PlacementError

codegen.ensure()  # the gRPC modules, before deploy.serve.grpc_api imports them

from deploy.rpc import specfleet_pb2 as pb  # noqa: E402
from deploy.serve.grpc_api import GrpcService  # noqa: E402
from deploy.serve.http_app import build_http_app  # noqa: E402

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


LOAD_TIMEOUT_S = 900.0  # for an instance to load its models, and for room to place it when its node is gone
HEALTH_TIMEOUT_S = 20.0
# Serve asks each instance replica for its health this often and replaces it after 3 failed checks in a row (Ray
# Serve's REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD), so a dead instance is seen within about 3 periods: 3 s, where
# the default 10 s period took 30 s and our former 2 s took 6 s; the check is one actor call, cheap at 1 s
HEALTH_PERIOD_S = 1.0


def router_client(cfg: RouterConfig) -> RouterClient:
    """The router of this cluster, found again (or started again) by name whenever it died."""
    return RouterClient.resolving(lambda: get_or_create_router(cfg), reconnect_s=cfg.reconnect_s)


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class SpecfleetInstance:
    """One planned engine instance: owns its InstanceServer actor and keeps it registered with the router.

    Its health is its instance's alone: the router being away (restarting, killed) never fails it; registration is
    kept up beside the health checks, with the router found again by name when it comes back."""

    def __init__(self, index: int, spec: InstanceSpec, router_cfg: RouterConfig, fleet_cfg: FleetConfig) -> None:
        began = time.monotonic()
        self.instance_id = spec.instance_id
        self.fleet_cfg = fleet_cfg
        self.role = router_cfg.disaggregation.role_of(index)  # prefill, decode or both (docs/disaggregation.md)
        self.router = router_client(router_cfg)
        try:  # requests waiting for an instance wait for this start (cluster/start_times.py)
            self.router.sync.starting(self.instance_id, timeout_s=HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the router is away: start anyway; it learns of us at registration
            log.warning("%s: could not tell the router it starts (%s: %s)", self.instance_id, type(e).__name__, e)
        # the instance knows its role: a router that restarts takes it from the instance's registration
        spec = spec.model_copy(update={"role": self.role})
        self.spec, self.server, self.info = self._start(index, spec, began + LOAD_TIMEOUT_S)
        self.start_s = time.monotonic() - began  # what the router's failover wait learns from (cluster/start_times.py)
        log.info("%s: %s runs on the %s", self.instance_id, spec.engine.model.target, self.info.backend)
        self.phases = self._phases()
        self.router.sync.register(*self._registration())
        self._registering: asyncio.Task | None = None

    def _start(self, index: int, spec: InstanceSpec, deadline: float):
        """Place, spawn and load the instance: (spec, server, info). A node of its place that Ray declares dead
        while it loads (the place was planned before Ray noticed), or a load that fails, makes it plan again."""
        while True:
            placed = self._placed(index, spec, deadline)
            name = f"{INSTANCE_ACTOR_PREFIX}{self.instance_id}/{uuid.uuid4().hex[:8]}"  # the router finds it by name
            server = InstanceServer.spawn(placed, resources={**InstanceServer.pin(placed),
                                                             **self.fleet_cfg.instance_resources},
                                          name=name, namespace=NAMESPACE)
            loading = server.info.remote()  # models load here
            failure = f"not loaded within {LOAD_TIMEOUT_S:.0f} s"
            while not ray.wait([loading], timeout=2.0)[0]:
                gone = {node for node, _ in placed.layout.places} - live_nodes()
                if gone:
                    failure = f"its nodes {sorted(gone)} died"
                    break
                if time.monotonic() > deadline:
                    break
            else:
                try:
                    return placed, server, ray.get(loading)
                except ray.exceptions.RayError as e:
                    failure = f"{type(e).__name__}: {e}"
            ray.kill(server, no_restart=True)  # its placement group goes with it
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.instance_id} did not start: {failure}")
            log.warning("%s: starting on %s failed (%s); planning again", self.instance_id, placed.place, failure)

    def _placed(self, index: int, spec: InstanceSpec, deadline: float) -> InstanceSpec:
        """The spec to start: as planned if its place is alive and free, else planned again over the nodes alive
        now; with no room, wait for a node to join (until `deadline`)."""
        while True:
            try:
                rows = self.router.sync.instances()
            except Exception as e:  # noqa: BLE001 - no router to ask: plan as if no other instance held a device
                log.warning("%s: no instances from the router (%s: %s)", self.instance_id, type(e).__name__, e)
                rows = []
            taken = set().union(*(r.place.places for r in rows if r.instance_id != self.instance_id))
            try:
                placed = replan(spec, self.fleet_cfg, index, taken)
            except PlacementError as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s: no room to start it now (%s); waiting for a node to join", self.instance_id, e)
                time.sleep(2.0)
                continue
            if placed.layout != spec.layout:
                log.warning("%s: planned again over the nodes alive now: %s", self.instance_id, placed.place)
            return placed

    def _phases(self) -> tuple[tuple[str, float], ...]:
        """Where the start went: the replica's own part (asking the router, placing) and its instance's phases
        (actors/start_phases.py); () if the instance does not say within the health timeout."""
        try:
            got = ray.get(self.server.start_phases.remote(), timeout=HEALTH_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as e:  # the start counts; only its breakdown is missing
            log.warning("%s: no start phases from the instance (%s: %s)", self.instance_id, type(e).__name__, e)
            return ()
        return (("replica", round(max(0.0, self.start_s - got.total_s), 3)),) + got.phases

    def _registration(self) -> tuple:
        """`router.register`'s arguments for this incarnation (cluster/router.py)."""
        i = self.info
        return (self.instance_id, self.server, i.model, i.max_model_len, i.node_id, self.spec.place, i.actor_id,
                self.start_s, i.backend, self.phases, self.role)

    async def check_health(self) -> None:
        """Serve calls this every few seconds; raising makes Serve replace the replica (and so the instance). Only
        the instance's own health counts; registration is kept up beside it, in a supervised task."""
        health = await asyncio.wait_for(self.server.health.remote(), HEALTH_TIMEOUT_S)
        if not health.healthy:
            raise RuntimeError(f"instance {self.instance_id} is unhealthy: {health.error}")
        if self._registering is None or self._registering.done():
            self._registering = asyncio.get_running_loop().create_task(self._keep_registered())

    async def _keep_registered(self) -> None:
        """Register again if the router does not know this incarnation (it restarted, or removed us), or not its role
        (an instance started before instances reported their roles: a restarted router took it as `both`)."""
        try:
            known = await self.router.is_registered(self.instance_id, self.info.actor_id, self.role,
                                                    timeout_s=HEALTH_TIMEOUT_S)
            if not known:
                await self.router.register(*self._registration(), timeout_s=HEALTH_TIMEOUT_S)
                log.warning("%s registered again with the router", self.instance_id)
        except Exception as e:  # noqa: BLE001 - the router is away: the next health check tries again
            log.warning("%s: could not reach the router (%s: %s)", self.instance_id, type(e).__name__, e)

    async def instance_id_(self) -> str:
        return self.instance_id

    def __del__(self) -> None:
        try:  # only this incarnation: a replacement may have registered under the same id already
            self.router.handle.deregister.remote(self.instance_id, self.info.actor_id)
            ray.kill(self.server, no_restart=True)
        except Exception:  # noqa: BLE001 - best effort at teardown; the router also drops instances that vanish
            log.warning("could not deregister instance %s at shutdown", getattr(self, "instance_id", "?"))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()  # late-bound: the app is built per replica, over its context (__serve_build_asgi_app__)
class SpecfleetAPI:
    """The ingress: HTTP routes (FastAPI APIRouters, deploy/serve/http_app.py) and gRPC methods over one ApiContext.

    The root config is read here, once: each part gets its own (the frontend its FrontendConfig, the edge and the
    routes the serve section, the router client the router section); the routes and the gRPC methods receive the
    context explicitly (deploy/serve/api_context.py)."""

    def __init__(self, cfg: SpecfleetConfig, instances: list[DeploymentHandle],
                 autoscaler: DeploymentHandle | None = None) -> None:
        from deploy.model_store import resolve_model
        from deploy.serve.api_context import ApiContext
        from deploy.serve.auth import KeySet
        from deploy.serve.cached import Cached
        from deploy.serve.edge import Edge
        from deploy.serve.frontend import Frontend
        from deploy.serve.frontend_config import frontend_config

        self.instances = instances  # keeps the instance deployments part of the app
        router = router_client(cfg.router)
        router.sync.configure(cfg.router, timeout_s=30)
        frontend = Frontend(frontend_config(cfg), router, resolve=lambda s: resolve_model(s, cfg.engine.model.dtype))
        self.context = ApiContext(
            serve=cfg.serve, frontend=frontend, edge=Edge(cfg.serve, frontend), router=router,
            api_keys=KeySet.load(cfg.serve.auth), admin_keys=KeySet.load(cfg.serve.auth, admin=True),
            # what the unauthenticated /health, /metrics and gRPC Health read: one router call a second per replica
            instances_view=Cached(lambda: router.instances()),
            fleet_view=Cached(lambda: asyncio.gather(router.instances(), router.migration_stats(),
                                                     router.routing_stats())),
            autoscaler=autoscaler)  # fleet.autoscaling's (deploy/serve/autoscaler.py), None for a fixed fleet
        self.grpc = GrpcService(self.context)
        # fleet.autoscaling: this replica's measured first tokens go to the autoscaler every round (its TTFT signal)
        self.reporter = None if autoscaler is None else TtftReporter(
            frontend.first_tokens, serve.get_replica_context().replica_id.unique_id,
            lambda report: autoscaler.report_ttft.remote(report), cfg.fleet.autoscaling.interval_s)
        self._reporting: asyncio.Task | None = None
        c = self.context
        log.info("API keys: %d for /v1 and gRPC, %d for /admin (from %s)", len(c.api_keys), len(c.admin_keys),
                 c.api_keys.source)

    async def check_health(self) -> None:
        """Serve calls this every few seconds: it starts the TTFT reports' loop (fleet.autoscaling) and watches it."""
        if self.reporter is None:
            return
        if self._reporting is None:
            self._reporting = asyncio.get_running_loop().create_task(self.reporter.run())
        elif self._reporting.done():  # it runs for good: an end is a defect; Serve replaces this replica
            raise RuntimeError(f"the TTFT reports' loop ended: {self._reporting.exception()!r}")

    def __serve_build_asgi_app__(self) -> FastAPI:  # noqa: N807 - Serve's hook, called after __init__
        return build_http_app(self.context)

    # gRPC (service specfleet.v1.Specfleet): Serve's gRPC proxy calls the ingress's methods by name
    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:  # noqa: N802
        return await self.grpc.Generate(request, grpc_context)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context  # noqa: N802
                             ) -> AsyncIterator[pb.GenerateChunk]:
        async with contextlib.aclosing(self.grpc.GenerateStream(request, grpc_context)) as chunks:
            async for chunk in chunks:  # closed at once when the client cancels (it aborts the request)
                yield chunk

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:  # noqa: N802
        return await self.grpc.ListModels(request, grpc_context)

    async def Health(self, request: pb.HealthRequest, grpc_context) -> pb.HealthResponse:  # noqa: N802
        return await self.grpc.Health(request, grpc_context)

    async def FleetStats(self, request: pb.FleetStatsRequest, grpc_context) -> pb.FleetStatsResponse:  # noqa: N802
        return await self.grpc.FleetStats(request, grpc_context)


def build_app(args: dict) -> serve.Application:
    """Serve's application builder: the instance deployment (one replica per instance) and the API in front."""
    return compose(config_from_args(args or {}))


def compose(cfg: SpecfleetConfig, replica_resources: dict[str, float] | None = None,
            instance_env: dict[str, str] | None = None) -> serve.Application:
    """The application for `cfg`, its fleet planned once (deploy/serve/fleet.py). `replica_resources`: Ray resources
    the API's and the instance deployments' replicas also ask for (the fault tests keep them on the head node);
    `instance_env`: environment variables of the instance replicas, inherited by their instance actors (the fault
    kit's actors.serving.server.START_DELAY_ENV)."""
    specs = fleet_specs(cfg)
    if specs:  # the API reads the model (tokenizer, template) in the dtype the instances chose (`dtype: auto`)
        model = cfg.engine.model.model_copy(update={"dtype": specs[0].engine.model.dtype})
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"model": model})})
    extra = dict(replica_resources or {})
    actor_opts: dict = {"num_cpus": 0, "resources": extra} if extra else {}
    if instance_env:
        actor_opts = {"num_cpus": 0, **actor_opts, "runtime_env": {"env_vars": dict(instance_env)}}
    opts = {"ray_actor_options": actor_opts} if actor_opts else {}
    instances = [SpecfleetInstance.options(name=f"SpecfleetInstance-{s.instance_id}", num_replicas=1, **opts)
                 .bind(i, s, cfg.router, cfg.fleet) for i, s in enumerate(specs)]
    api = SpecfleetAPI.options(ray_actor_options={"num_cpus": 0, "resources": {**cfg.serve.api_resources, **extra}})
    autoscaler = None  # fleet.autoscaling: one replica that adds instances planned as these are, and drains them
    if cfg.fleet.autoscaling is not None and specs:
        autoscaler = SpecfleetAutoscaler.options(name="SpecfleetAutoscaler", num_replicas=1,
                                                 ray_actor_options={"num_cpus": 0, "resources": extra})
        autoscaler = autoscaler.bind(cfg, specs[0])
    return api.bind(cfg, instances, autoscaler)


__all__ = ["build_app", "compose", "find_router", "APP_NAME"]
