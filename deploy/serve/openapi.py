"""The OpenAPI document the app serves at `/openapi.json`: FastAPI's routes plus what the handlers read by hand.

The handlers parse their bodies and query parameters themselves (deploy/serve/http_api.py), so FastAPI alone
would describe neither. Here the document gets the request bodies (the pydantic models of
deploy/serve/openai_api.py), the query parameters, the bearer keys (`/v1`: an API key, `/admin`: an admin key)
and the OpenAI error body that every 4xx and 5xx carries. Clients can read it; the fuzzing tests
(tests/serve/test_fuzz.py) generate requests from it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from deploy.serve.openai_api import ChatCompletionRequest, CompletionRequest
from deploy.serve.responses_api import ResponsesRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest}
_BOOL = {"type": "string", "enum": ["true", "false", "1", "0", "yes", "no"]}
QUERY = {
    ("/admin/requests", "get"): {"status": {"type": "string", "enum": ["running", "finished", "aborted", "failed"]}},
    ("/admin/requests/{request_id}/migrate", "post"): {"to": {"type": "string"}},
    ("/admin/instances/{instance_id}/drain", "post"): {"migrate": _BOOL, "abort": _BOOL},
}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def install(app: FastAPI) -> None:
    """Make `app` serve the document built here (once, on first request)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema


def build(app: FastAPI) -> dict:
    doc = get_openapi(title="specfleet", version="1", routes=app.routes,
                      description="OpenAI-compatible completions with lossless speculative decoding")
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's 422 body: never sent here (errors are 400s)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR
    components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"},
                                     "adminKey": {"type": "http", "scheme": "bearer"}}
    error = {"description": "an OpenAI-style error",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            op["responses"].pop("422", None)
            op["responses"].update({"4XX": error, "5XX": error})
            if path.startswith("/v1"):
                op["security"] = [{"apiKey": []}]
            elif path.startswith("/admin"):
                op["security"] = [{"adminKey": []}]
            for name, schema in QUERY.get((path, method), {}).items():
                op.setdefault("parameters", []).append({"name": name, "in": "query", "required": False,
                                                        "schema": schema})
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc
