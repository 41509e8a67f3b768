"""The API replica's FastAPI app: its routers, its error bodies and its OpenAPI document, over one ApiContext.

The routes live on APIRouters by concern: the OpenAI API (deploy/serve/http_api.py), the Responses API
(deploy/serve/responses_routes.py), and health, metrics and the operator's /admin (deploy/serve/admin_routes.py).
Each handler receives the replica's ApiContext through FastAPI's dependency injection (deploy/serve/api_context.py),
so the app is built per replica, after its context: the ingress's `__serve_build_asgi_app__` (Ray Serve's
late-bound ingress, `@serve.ingress()` without an app) calls `build_http_app(context)`. Built without a context,
the app still describes every route (its OpenAPI document, for the fuzzing tests) but serves none.

Every error is an OpenAI-style body: APIError as raised, Starlette's own (404 for an unknown path, 405) in the
same shape, and anything unexpected as a 500 whose detail stays in the log.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.serve import openapi
from deploy.serve.admin_routes import routes as admin_routes
from deploy.serve.api_context import ApiContext
from deploy.serve.http_api import routes as openai_routes
from deploy.serve.openai_api import APIError
from deploy.serve.responses_routes import routes as responses_routes

log = logging.getLogger(__name__)


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    err = APIError(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500 else "server_error")
    return JSONResponse(err.body(), status_code=e.status_code)


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error in a request")
    err = APIError(500, f"internal error: {type(e).__name__}", type_="server_error")
    return JSONResponse(err.body(), status_code=500)


def build_http_app(context: ApiContext | None = None) -> FastAPI:
    """The app whose routes receive `context` (None: an app for its schema only)."""
    app = FastAPI(title="specfleet", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    openapi.install(app)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    for router in (openai_routes, responses_routes, admin_routes):
        app.include_router(router)
    app.state.context = context
    return app
