"""The HTTP app's routes receive the replica's ApiContext as a FastAPI dependency (deploy/serve/http_app.py).

In process, without Ray: a real Frontend (a tiny model's tokenizer), Edge and key sets behind the app; only the
checks that come before any router call run here (the served app's tests in tests/serve hold the rest). The same
app built without a context describes the same routes and answers with an OpenAI-style 500, never a traceback.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from cluster.config import AuthConfig, EngineConfig, ModelConfig, ServeConfig, SpecfleetConfig
from cluster.router_client import RouterClient
from deploy.serve.api_context import ApiContext
from deploy.serve.auth import KeySet
from deploy.serve.cached import Cached
from deploy.serve.edge import Edge
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from deploy.serve.http_app import build_http_app

KEY, ADMIN = "sk-unit", "sk-unit-admin"


async def _no_router():
    raise AssertionError("no route here may reach the router")


@pytest.fixture(scope="module")
def client(tiny_models) -> TestClient:
    cfg = SpecfleetConfig(engine=EngineConfig(model=ModelConfig(target=str(tiny_models["llama"]), name="tiny")),
                          serve=ServeConfig(max_request_bytes=4096,
                                            auth=AuthConfig(api_keys=(SecretStr(KEY),), admin_keys=(SecretStr(ADMIN),),
                                                            api_keys_env="UNIT_NO_KEYS", admin_keys_env="UNIT_NO_KEYS")))
    router = RouterClient(None, reconnect_s=1.0)
    frontend = Frontend(frontend_config(cfg), router)
    api = ApiContext(serve=cfg.serve, frontend=frontend, edge=Edge(cfg.serve, frontend), router=router,
                     api_keys=KeySet.load(cfg.serve.auth), admin_keys=KeySet.load(cfg.serve.auth, admin=True),
                     instances_view=Cached(_no_router), fleet_view=Cached(_no_router))
    return TestClient(build_http_app(api), raise_server_exceptions=False)


def _error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert (param is None or err["param"] == param) and (code is None or err["code"] == code), err
    return err


def test_each_router_reaches_the_context_its_keys_and_its_edge(client: TestClient) -> None:
    for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("post", "/v1/responses")):
        _error(getattr(client, method)(path), 401, code="invalid_api_key")
    for method, path in (("get", "/admin/instances"), ("post", "/admin/requests/x/abort"),
                         ("post", "/admin/instances/i/undrain")):
        err = _error(client.request(method, path, headers={"Authorization": f"Bearer {KEY}"}), 401)
        assert "admin key" in err["message"]  # an API key is no admin key
    auth = {"Authorization": f"Bearer {KEY}"}
    _error(client.post("/v1/completions", headers=auth, json={"model": "other", "prompt": "hi"}), 404, "model",
           "model_not_found")  # the frontend's served name
    _error(client.post("/v1/chat/completions", headers=auth, content=b"{"), 400)  # the body parser
    _error(client.post("/v1/responses", headers=auth, json={"model": "tiny", "input": "x" * 5000}), 413,
           code="request_too_large")  # the serve section's limit
    _error(client.get("/admin/requests?status=odd", headers={"Authorization": f"Bearer {ADMIN}"}), 400, "status")
    _error(client.get("/nowhere"), 404)


def test_an_app_without_a_context_describes_the_same_routes_and_serves_none() -> None:
    bare = TestClient(build_http_app(), raise_server_exceptions=False)
    paths = set(bare.get("/openapi.json").json()["paths"])
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/health", "/metrics",
            "/admin/instances/{instance_id}/drain"} <= paths
    err = _error(bare.get("/health"), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
