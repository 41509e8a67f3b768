"""A router handle that outlives the router: each call has a deadline, and a router found dead is found again by name.

    router = RouterClient.resolving(lambda: get_or_create_router(cfg), reconnect_s=cfg.reconnect_s)
    instance_id, handle = await router.route(rid, 0, model, limit, timeout_s=30)
    router.sync.configure(cfg, timeout_s=30)  # the same, for synchronous code (a deployment's constructor)

Each of the router's methods has a typed method here with the router's own signature (cluster/router.py), so the type
checker sees every call; `timeout_s` (keyword) overrides the client's deadline. Methods the router must not run twice
(`migrate`, `drain_migrate`, `expert_routing`: `max_task_retries=0` there) are never tried again here either.
`call` stays for a method not wrapped yet.

The router (cluster/router.py) restarts when its process dies; Ray then answers calls meanwhile with
ActorUnavailableError, and retries those under way on the new process where the method is idempotent. An actor
killed for good raises ActorDiedError on every later call through the old handle: then `resolve` (which creates the
router again if nobody has yet) gives the new one. Either way the call is tried again, with a growing pause, until
`reconnect_s` have passed since it began; then the last error is raised. API replicas and instance deployments
(deploy/serve/) hold one of these.

Every call is submitted outside the caller's contextvars (a fresh Context), so it is never a child of a Serve
request that `ray.cancel` may cancel recursively (deploy/serve/frontend.py explains why that matters).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError

if TYPE_CHECKING:
    from cluster.config import RouterConfig
    from cluster.disagg import PromptShape, Role
    from cluster.instances import DrainResult, InstancePlace, InstanceRow, RequestRow
    from cluster.migration import MigrationResult
    from cluster.request import RequestStatus
    from cluster.start_times import FailoverWait
    from cluster.stats import MigrationStats, RoutingStats

log = logging.getLogger(__name__)
GONE = (ActorDiedError, ActorUnavailableError)  # the router is restarting, or dead: try again (anew)
FIRST_PAUSE_S, MAX_PAUSE_S = 0.2, 2.0


class RouterClient:
    """A router handle with deadlines and re-resolution. `resolve` gives the current router (None: a fixed handle
    that is never replaced, e.g. a test's own router; calls still get deadlines)."""

    def __init__(self, handle: ActorHandle, resolve: Callable[[], ActorHandle] | None = None,
                 reconnect_s: float = 20.0, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self._resolve = resolve
        self.reconnect_s, self.timeout_s = reconnect_s, timeout_s
        self.sync = BlockingRouterClient(self)

    @classmethod
    def resolving(cls, resolve: Callable[[], ActorHandle], reconnect_s: float = 20.0,
                  timeout_s: float = 60.0) -> "RouterClient":
        return cls(resolve(), resolve, reconnect_s, timeout_s)

    async def call(self, fn: Callable[[ActorHandle], ObjectRef], *, timeout_s: float | None = None,
                   retry: bool = True) -> Any:
        """`fn(router)`'s result, awaited for at most `timeout_s` (default: the client's); a router that is gone
        is tried again (re-resolved if dead) until `reconnect_s` have passed, unless `retry` is False (a call that
        must not run twice)."""
        deadline = time.monotonic() + self.reconnect_s
        pause = FIRST_PAUSE_S
        while True:
            handle = self.handle
            try:
                ref = contextvars.Context().run(fn, handle)
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s or self.timeout_s)
            except GONE as e:
                if not retry or time.monotonic() + pause > deadline:
                    raise
                log.warning("the router is gone (%s); trying again in %.1f s", type(e).__name__, pause)
                await asyncio.sleep(pause)
                if isinstance(e, ActorDiedError):
                    await asyncio.to_thread(self._reresolve, handle)
                pause = min(2 * pause, MAX_PAUSE_S)

    def call_blocking(self, fn: Callable[[ActorHandle], ObjectRef], *, timeout_s: float | None = None) -> Any:
        """`call` for synchronous code (a deployment's constructor): the same deadline and retries."""
        deadline = time.monotonic() + self.reconnect_s
        pause = FIRST_PAUSE_S
        while True:
            handle = self.handle
            try:
                return ray.get(fn(handle), timeout=timeout_s or self.timeout_s)
            except GONE as e:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("the router is gone (%s); trying again in %.1f s", type(e).__name__, pause)
                time.sleep(pause)
                if isinstance(e, ActorDiedError):
                    self._reresolve(handle)
                pause = min(2 * pause, MAX_PAUSE_S)

    def _reresolve(self, dead: ActorHandle) -> None:
        if self._resolve is not None and self.handle == dead:  # another call may have found the new one already
            self.handle = self._resolve()

    # ---- requests (deploy/serve/frontend.py) ---------------------------------------------------------
    async def route(self, request_id: str, priority: int = 0, model: str | None = None, max_pending: int | None = None,
                    blocks: tuple[int, ...] = (), prompt: PromptShape | None = None, *, timeout_s: float | None = None
                    ) -> tuple[str, ActorHandle]:
        """The instance for a new request: (instance id, its handle). Overloaded or NoInstanceAvailable."""
        return await self.call(lambda r: r.route.remote(request_id, priority, model, max_pending, blocks, prompt),
                               timeout_s=timeout_s)

    async def finish(self, request_id: str, status: RequestStatus, *, timeout_s: float | None = None) -> None:
        """The request ended with `status` (idempotent: a request already ended keeps its status)."""
        await self.call(lambda r: r.finish.remote(request_id, status), timeout_s=timeout_s)

    async def failover(self, request_id: str, failed_instance: str, failed_handle: ActorHandle | None = None,
                       priority: int = 0, model: str | None = None, blocks: tuple[int, ...] = (), *,
                       timeout_s: float | None = None) -> tuple[str, ActorHandle]:
        """Where a request whose instance failed resumes: (instance id, its handle)."""
        return await self.call(lambda r: r.failover.remote(request_id, failed_instance, failed_handle, priority,
                                                           model, blocks), timeout_s=timeout_s)

    # ---- instances (deploy/serve/app.py) --------------------------------------------------------------
    async def is_registered(self, instance_id: str, incarnation: str | None = None, role: Role | None = None, *,
                            timeout_s: float | None = None) -> bool:
        return await self.call(lambda r: r.is_registered.remote(instance_id, incarnation, role), timeout_s=timeout_s)

    async def register(self, instance_id: str, handle: ActorHandle, model: str, max_model_len: int, node: str,
                       place: InstancePlace, incarnation: str, start_s: float | None, backend: str,
                       phases: tuple[tuple[str, float], ...], role: Role = "both", *,
                       timeout_s: float | None = None) -> None:
        """Add an instance, or its replacement (another `incarnation` under the same id); idempotent."""
        await self.call(lambda r: r.register.remote(instance_id, handle, model, max_model_len, node, place,
                                                    incarnation, start_s, backend, phases, role), timeout_s=timeout_s)

    # ---- what the API reads (deploy/serve/http_api.py, grpc_api.py, app.py) --------------------------
    async def models(self, *, timeout_s: float | None = None) -> dict[str, int]:
        return await self.call(lambda r: r.models.remote(), timeout_s=timeout_s)

    async def instances(self, *, timeout_s: float | None = None) -> list[InstanceRow]:
        return await self.call(lambda r: r.instances.remote(), timeout_s=timeout_s)

    async def removed_instances(self, *, timeout_s: float | None = None) -> list[InstanceRow]:
        return await self.call(lambda r: r.removed_instances.remote(), timeout_s=timeout_s)

    async def migration_stats(self, *, timeout_s: float | None = None) -> MigrationStats:
        return await self.call(lambda r: r.migration_stats.remote(), timeout_s=timeout_s)

    async def failover_wait(self, *, timeout_s: float | None = None) -> FailoverWait:
        return await self.call(lambda r: r.failover_wait.remote(), timeout_s=timeout_s)

    async def routing_stats(self, *, timeout_s: float | None = None) -> RoutingStats:
        return await self.call(lambda r: r.routing_stats.remote(), timeout_s=timeout_s)

    async def requests(self, status: RequestStatus | None = None, *,
                       timeout_s: float | None = None) -> list[RequestRow]:
        return await self.call(lambda r: r.requests.remote(status), timeout_s=timeout_s)

    # ---- operators' commands (deploy/serve/http_api.py) ---------------------------------------------
    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        return await self.call(lambda r: r.abort.remote(request_id), timeout_s=timeout_s)

    async def drain(self, instance_id: str, abort_running: bool = False, *, timeout_s: float | None = None) -> int:
        return await self.call(lambda r: r.drain.remote(instance_id, abort_running), timeout_s=timeout_s)

    async def undrain(self, instance_id: str, *, timeout_s: float | None = None) -> None:
        await self.call(lambda r: r.undrain.remote(instance_id), timeout_s=timeout_s)

    async def drain_migrate(self, instance_id: str, *, timeout_s: float | None = None) -> DrainResult:
        """Not idempotent: never tried again."""
        return await self.call(lambda r: r.drain_migrate.remote(instance_id), retry=False, timeout_s=timeout_s)

    async def migrate(self, request_id: str, to: str | None = None, *,
                      timeout_s: float | None = None) -> MigrationResult:
        """Not idempotent: never tried again."""
        return await self.call(lambda r: r.migrate.remote(request_id, to), retry=False, timeout_s=timeout_s)

    async def expert_routing(self, instance_id: str, *, timeout_s: float | None = None) -> bytes:
        """Not idempotent (it resets the instance's counts): never tried again."""
        return await self.call(lambda r: r.expert_routing.remote(instance_id), retry=False, timeout_s=timeout_s)


class BlockingRouterClient:
    """The router calls synchronous code makes (a deployment's constructor), through `RouterClient.call_blocking`:
    the same deadlines and retries."""

    def __init__(self, client: RouterClient) -> None:
        self._client = client

    def configure(self, cfg: RouterConfig, *, timeout_s: float | None = None) -> None:
        self._client.call_blocking(lambda r: r.configure.remote(cfg), timeout_s=timeout_s)

    def starting(self, instance_id: str, *, timeout_s: float | None = None) -> None:
        """An instance starts: requests waiting for one wait for it (cluster/start_times.py)."""
        self._client.call_blocking(lambda r: r.starting.remote(instance_id), timeout_s=timeout_s)

    def instances(self, *, timeout_s: float | None = None) -> list[InstanceRow]:
        return self._client.call_blocking(lambda r: r.instances.remote(), timeout_s=timeout_s)

    def register(self, instance_id: str, handle: ActorHandle, model: str, max_model_len: int, node: str,
                 place: InstancePlace, incarnation: str, start_s: float | None, backend: str,
                 phases: tuple[tuple[str, float], ...], role: Role = "both", *,
                 timeout_s: float | None = None) -> None:
        self._client.call_blocking(lambda r: r.register.remote(instance_id, handle, model, max_model_len, node, place,
                                                               incarnation, start_s, backend, phases, role),
                                   timeout_s=timeout_s)
