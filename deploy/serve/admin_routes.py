"""HTTP routes of the API replica besides the OpenAI API: /health, /metrics and the operator's /admin.

/health and /metrics need no key and read the replica's cached fleet views (deploy/serve/cached.py); every /admin
route needs an admin key, and each action (abort, drain, migrate, undrain) goes to the audit log. Each handler
receives the replica's ApiContext as a dependency (deploy/serve/api_context.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cluster.autoscale import AutoscaleStatus
from cluster.registry import NoInstanceAvailable
from cluster.request import RequestStatus
from deploy.serve.api_context import Api, ApiContext
from deploy.serve.metrics import CONTENT_TYPE
from deploy.serve.openai_api import APIError

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 600.0  # a migration or a migrating drain, which move requests one after another
AUTOSCALER_TIMEOUT_S = 5.0  # the autoscaler replica answers its status from memory

routes = APIRouter()


def _admin(request: Request, api: ApiContext):
    return api.authorize(request.headers.get("authorization"), admin=True)


# ---- health and metrics -------------------------------------------------------------------------------
@routes.get("/health")
async def health(api: Api) -> Response:
    instances = await api.instances_view.get()  # reused for a second (deploy/serve/cached.py)
    healthy = sum(i.accepting for i in instances)
    return JSONResponse({"status": "ok" if healthy else "unavailable", "healthy_instances": healthy},
                        status_code=200 if healthy else 503)


@routes.get("/metrics")
async def metrics(api: Api) -> Response:
    instances, migrations, routing = await api.fleet_view.get()  # reused for a second
    m = api.frontend.metrics
    m.set_instances(instances)
    m.migration_figures = migrations
    m.routing_figures = routing
    m.autoscale_figures = await _autoscale_status(api)
    return Response(m.render(), media_type=CONTENT_TYPE)


async def _autoscale_status(api: ApiContext) -> AutoscaleStatus | None:
    """The autoscaler's status (deploy/serve/autoscaler.py); None for a fixed fleet, or while it does not answer
    (logged: the rest of /metrics still answers)."""
    if api.autoscaler is None:
        return None
    try:
        return await asyncio.wait_for(api.autoscaler.status.remote(), AUTOSCALER_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - figures of one part missing must not fail the whole scrape
        log.warning("the autoscaler did not answer (%s: %s)", type(e).__name__, e)
        return None


# ---- admin --------------------------------------------------------------------------------------------
@routes.get("/admin/instances")
async def admin_instances(request: Request, api: Api) -> Response:
    _admin(request, api)
    rows, removed = await asyncio.gather(api.router.instances(), api.router.removed_instances())
    return JSONResponse({"instances": [r.model_dump(mode="json") for r in rows],
                         "removed": [r.model_dump(mode="json") for r in removed]})


@routes.get("/admin/migrations")
async def admin_migrations(request: Request, api: Api) -> Response:
    # the router's migration and failover figures (cluster/stats.py, MigrationStats)
    _admin(request, api)
    figures, wait = await asyncio.gather(api.router.migration_stats(), api.router.failover_wait())
    return JSONResponse({**figures.as_dict(), "downtime_mean_s": figures.downtime_mean_s,
                         "failover_wait": dataclasses.asdict(wait)})


@routes.get("/admin/dispatch")
async def admin_dispatch(request: Request, api: Api) -> Response:
    # the router's dispatch policy, its decisions by reason and its prefix index (cluster/stats.py, RoutingStats)
    _admin(request, api)
    return JSONResponse((await api.router.routing_stats()).as_dict())


@routes.get("/admin/autoscaler")
async def admin_autoscaler(request: Request, api: Api) -> Response:
    # the autoscaler's bounds, last decision and recent scale steps (cluster/autoscale.py, AutoscaleStatus)
    _admin(request, api)
    if api.autoscaler is None:
        return JSONResponse({"enabled": False})
    status = await asyncio.wait_for(api.autoscaler.status.remote(), AUTOSCALER_TIMEOUT_S)
    return JSONResponse({"enabled": True, **dataclasses.asdict(status)})


@routes.get("/admin/requests")
async def admin_requests(request: Request, api: Api) -> Response:
    _admin(request, api)
    status = request.query_params.get("status")
    if status not in (None, "running", "finished", "aborted", "failed"):
        raise APIError(400, f"unknown status {status!r}", param="status")
    rows = await api.router.requests(RequestStatus(status) if status else None)
    return JSONResponse({"requests": [row.model_dump(mode="json") for row in rows]})


@routes.post("/admin/requests/{request_id}/abort")
async def admin_abort(request_id: str, request: Request, api: Api) -> Response:
    admin = _admin(request, api)
    found = await api.router.abort(request_id)
    api.audit(request, admin, "abort", request_id, "ok" if found else "not found")
    if not found:
        raise APIError(404, f"no running request {request_id!r} (unknown, or it has just ended)", param="request_id",
                       code="request_not_found")
    return JSONResponse({"request_id": request_id, "aborted": True})


@routes.post("/admin/requests/{request_id}/migrate")
async def admin_migrate(request_id: str, request: Request, api: Api) -> Response:
    # live-migrate a running request (`to`: the destination instance; default: where dispatch would send it)
    admin = _admin(request, api)
    try:
        to = request.query_params.get("to")
        api.audit(request, admin, "migrate", request_id, f"asked: to {to or 'dispatch'}")
        result = await api.router.migrate(request_id, to, timeout_s=ADMIN_TIMEOUT_S)
    except ValueError as e:
        raise APIError(404, _reason(e), param="request_id", code="request_not_found") from None
    except NoInstanceAvailable as e:
        raise APIError(409, f"no instance can take it: {_reason(e)}", param="to", code="no_destination") from None
    return JSONResponse({**dataclasses.asdict(result), "status": result.status.value})


@routes.post("/admin/instances/{instance_id}/drain")
async def admin_drain(instance_id: str, request: Request, api: Api) -> Response:
    # stop dispatching to an instance; `migrate=true` moves its running requests to the others (live migration),
    # `abort=true` aborts them, neither leaves them to finish there
    admin = _admin(request, api)
    flag = lambda name: request.query_params.get(name, "false").lower() in ("1", "true", "yes")  # noqa: E731
    abort, migrate = flag("abort"), flag("migrate")
    if abort and migrate:
        raise APIError(400, "choose migrate or abort, not both", param="migrate")
    api.audit(request, admin, "drain", instance_id, "asked: " + ("migrate" if migrate else
                                                                 "abort" if abort else "finish there"))
    try:
        if migrate:
            moved = await api.router.drain_migrate(instance_id, timeout_s=ADMIN_TIMEOUT_S)
            return JSONResponse(moved.model_dump(mode="json"))
        running = await api.router.drain(instance_id, abort)
    except ValueError as e:
        raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
    finally:
        api.changed()
    return JSONResponse({"instance_id": instance_id, "draining": True, "running": running, "aborted": abort})


@routes.get("/admin/instances/{instance_id}/routing")
async def admin_routing(instance_id: str, request: Request, api: Api) -> Response:
    # an expert-parallel instance's online routing statistics since the last call: a statistics file
    _admin(request, api)
    try:
        data = await api.router.expert_routing(instance_id)
    except ValueError as e:
        raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
    except LookupError as e:
        raise APIError(409, _reason(e), param="instance_id", code="not_expert_parallel") from None
    return Response(data, media_type="application/octet-stream")


@routes.post("/admin/instances/{instance_id}/undrain")
async def admin_undrain(instance_id: str, request: Request, api: Api) -> Response:
    api.audit(request, _admin(request, api), "undrain", instance_id, "asked")
    try:
        await api.router.undrain(instance_id)
    except ValueError as e:
        raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
    finally:
        api.changed()
    return JSONResponse({"instance_id": instance_id, "draining": False})


def _reason(e: BaseException) -> str:
    """An error's own message: a router call's error arrives wrapped in Ray's RayTaskError, traceback and all."""
    return str(getattr(e, "cause", None) or e)
