"""What the API's routes and gRPC methods work with (`ApiContext`), handed to them explicitly, and its dependency.

The ingress (deploy/serve/app.py) builds one context per replica and the HTTP app with it (deploy/serve/http_app.py);
each HTTP route receives it through FastAPI's dependency injection, `api: Api` (= `Depends(get_context)`), and the
gRPC methods (deploy/serve/grpc_api.py) hold it. Nothing reaches for attributes a host class promises to set.

    api = ApiContext(serve=cfg.serve, frontend=..., edge=..., router=..., api_keys=..., admin_keys=...)
    app = build_http_app(api)              # app.state.context = api
    @routes.get("/v1/models")
    async def models(request: Request, api: Api) -> Response: ...
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import Depends, Request

from cluster.config import ServeConfig
from cluster.router_client import RouterClient
from deploy.serve import audit
from deploy.serve.auth import KeySet, Tenant
from deploy.serve.cached import Cached
from deploy.serve.edge import Edge
from deploy.serve.frontend import Frontend
from deploy.serve.openai_api import APIError


@dataclasses.dataclass(frozen=True)
class ApiContext:
    """One API replica's parts: its config, frontend, edge, router client, keys and cached fleet views."""

    serve: ServeConfig  # body and message limits (the edge's own part is the Edge's)
    frontend: Frontend
    edge: Edge
    router: RouterClient  # routes call `await api.router.<method>(...)` (typed, with deadlines)
    api_keys: KeySet  # /v1 and gRPC
    admin_keys: KeySet  # /admin and gRPC FleetStats
    # what the unauthenticated /health, /metrics and gRPC Health read: one router call a second per replica
    instances_view: Cached[Any]
    fleet_view: Cached[Any]  # (instances, migration stats, routing stats)
    autoscaler: Any = None  # the autoscaler deployment's handle (deploy/serve/autoscaler.py); None: a fixed fleet

    def authorize(self, authorization: str | None, admin: bool = False) -> Tenant:
        """The tenant of an `Authorization: Bearer KEY` header, else a 401 (an admin key for `admin`)."""
        tenant = (self.admin_keys if admin else self.api_keys).match(authorization)
        if tenant is None:
            what = "admin key" if admin else "API key"
            raise APIError(401, f"missing or invalid {what}: send `Authorization: Bearer <key>`",
                           type_="authentication_error", code="invalid_api_key")
        return tenant

    def audit(self, request: Request, admin: Tenant, action: str, target: str, outcome: str) -> None:
        """An admin action in the audit log (deploy/serve/audit.py), with the admin key's id."""
        audit.record(action, target, admin, request.client.host if request.client else None, outcome)
        self.changed()

    def changed(self) -> None:
        """The fleet changed through this replica: its cached views (/health, /metrics) are read anew."""
        self.instances_view.invalidate()
        self.fleet_view.invalidate()


def get_context(request: Request) -> ApiContext:
    """The FastAPI dependency every route takes: the context the replica built its app with."""
    context = getattr(request.app.state, "context", None)
    if context is None:  # an app built only for its schema (tests/serve/test_fuzz.py) serves no request
        raise RuntimeError("this HTTP app was built without an ApiContext (deploy/serve/http_app.py)")
    return context


Api = Annotated[ApiContext, Depends(get_context)]
