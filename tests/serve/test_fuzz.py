"""Fuzzing the served app against its own OpenAPI schema (schemathesis, served by FastAPI at /openapi.json).

The schema is built here from the app's routes, the same document the app serves (checked below; schemathesis's
lazy `from_fixture` loading does not run under pytest 9), and the generated requests go to the served app.

Every route gets up to EXAMPLES generated requests (bodies, path and query parameters from the schema, valid and
not), with a key: the fuzz key for /v1 (its own limits, tests/serve/conftest.py), the admin key for /admin. No
answer may be a 5xx, and every 4xx carries an OpenAI-style JSON error body. Generated bodies name the served
model, so that they get past the model check into admission, tokenization and the engine.

The generator's seed rotates: a fresh one each run (another part of the input space each time), named in every
failure's message (and printed at collection, `-s`); `SPECFLEET_FUZZ_SEED=N` replays a run's cases.
"""

from __future__ import annotations

import json
import os
import secrets

import schemathesis
from hypothesis import HealthCheck, seed, settings

from deploy.serve import openapi
from deploy.serve.http_app import build_http_app
from tests.serve.conftest import ADMIN_KEY, LIMITED_KEYS, MODEL, ServedApp

EXAMPLES = 50  # per route at most (routes without parameters stop at the few cases there are); the seed rotates, so
# each run covers another part of the input space (250 per route took 116 s of the suite: issue 36)
SEED = int(os.environ.get("SPECFLEET_FUZZ_SEED") or secrets.randbits(32))
REPLAY = f"replay with SPECFLEET_FUZZ_SEED={SEED}"
print(f"tests/serve/test_fuzz.py: fuzz seed {SEED} ({REPLAY})")


http_app = build_http_app()  # the replica's app, without a context: the same routes, for their schema
schema = schemathesis.openapi.from_dict(openapi.build(http_app))


def test_the_fuzzed_schema_is_the_one_the_app_serves(served_app: ServedApp) -> None:
    with served_app.client() as c:
        assert c.get("/openapi.json").json() == json.loads(json.dumps(openapi.build(http_app)))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
          suppress_health_check=list(HealthCheck))
@seed(SEED)
def test_no_route_answers_a_generated_request_with_a_5xx_or_a_4xx_without_an_error_body(case, served_app) -> None:
    key = ADMIN_KEY if case.path.startswith("/admin") else LIMITED_KEYS["fuzz"][0]
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    response = case.call(base_url=served_app.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    status = response.status_code
    if case.path == "/health" and status == 503:  # its documented answer while no instance takes requests
        assert response.json()["status"] == "unavailable"
        return
    assert status < 500, (REPLAY, case.method, case.path, case.body, response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), REPLAY
