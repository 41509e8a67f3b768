"""A typed HTTP client for the Serve app's admin, health and model routes (httpx, no Ray): what the CLI calls.

    client = AdminClient("http://127.0.0.1:8000", admin_key="sk-...")
    for inst in client.instances().instances:
        print(inst.instance_id, inst.stats.load.running if inst.stats else "-")

Failures a user can fix (app not reachable, wrong key, unknown id) raise AdminError, a UsageError, so the CLI
prints the message and exits 2; the server failing (5xx) raises ServerError. Keys never appear in messages.
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict

from cluster.instances import DrainResult, InstanceRow, RequestRow
from deploy.cli.flags import UsageError

WRONG_ADMIN_KEY = "wrong admin key: set --admin-key or $SPECFLEET_ADMIN_KEYS or the config's admin_keys_file"
WRONG_API_KEY = "wrong API key: set --api-key or $SPECFLEET_API_KEYS or the config's api_keys_file"


class AdminError(UsageError):
    """The app cannot be reached, refused the key, or does not know the id asked for."""


class ServerError(RuntimeError):
    """The app answered with a server error (5xx) other than /health's 503."""


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer server may add fields


class Instances(_Row):
    instances: list[InstanceRow]
    removed: list[InstanceRow] = []


class Health(_Row):
    status: str  # "ok" or "unavailable"
    healthy_instances: int

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ModelRow(_Row):
    id: str
    max_model_len: int | None = None


class AbortResult(_Row):
    request_id: str
    aborted: bool


class MigrateResult(_Row):
    request_id: str
    status: str  # finished | aborted_src | aborted_dst (cluster/migration.py)
    reason: str = ""
    stages: int = 0
    tokens_copied: int = 0
    tokens_skipped: int = 0  # the destination's prefix cache held them: not copied
    bytes_copied: int = 0
    downtime_s: float = 0.0
    total_s: float = 0.0


class FailoverWaitRow(_Row):
    """How long a failed-over request now waits for an instance to register (cluster/start_times.py)."""

    wait_s: float
    slowest_s: float | None  # the slowest recent start or replacement; None: none seen yet
    floor_s: float
    ceiling_s: float
    multiple: float
    samples: int
    last_start: list[tuple[str, float]] = []  # the last start's seconds phase by phase (actors/start_phases.py)


class Migrations(_Row):
    """The router's migration and failover figures since it started (GET /admin/migrations)."""

    by_status: dict[str, int]  # finished | aborted_src | aborted_dst
    failovers: int
    downtime_count: int
    downtime_mean_s: float
    downtime_max_s: float
    failover_wait: FailoverWaitRow | None = None


class Dispatch(_Row):
    """The router's dispatch figures since it started (GET /admin/dispatch)."""

    policy: str
    decisions: dict[str, int]  # prefix | load_over_prefix | load (cluster/registry.py)
    index_entries: int
    index_instances: int
    disaggregation: dict[str, int] = {}  # placements by the prefill/decode pair policy, by reason (cluster/disagg.py)
    handoffs: dict[str, int] = {}  # prefilled requests moved to their decode instance, by outcome
    handoffs_pending: int = 0
    failed_rounds: dict[str, int] = {}  # rounds of the router's background loops that raised, by loop
    last_round_error: dict[str, str] = {}  # each such loop's last error


class ScaleEventRow(_Row):
    """One scale step of the autoscaler (cluster/autoscale.py, ScaleEvent)."""

    at: float
    action: str  # up | down
    instance_id: str
    reason: str
    outcome: str  # done | failed | cancelled
    detail: str = ""
    duration_s: float = 0.0
    migrated: int = 0


class DecisionRow(_Row):
    action: str  # up | down | hold
    reason: str
    instances: int
    remove: list[str] = []  # the instances a step down drains
    count: int = 1  # instances the step adds or removes


class Autoscaling(_Row):
    """The autoscaler's bounds, last decision and recent steps (GET /admin/autoscaler); `enabled` False for a fixed
    fleet."""

    enabled: bool
    min_instances: int = 0
    max_instances: int = 0
    instances: int = 0
    last: DecisionRow | None = None
    events: list[ScaleEventRow] = []
    counts: list[tuple[str, str, str, int]] = []  # (action, outcome, cause, steps)
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    failed_rounds: int = 0  # autoscaling rounds that raised
    last_failure: str = ""
    ttft_source: str | None = None  # measured (by the API replicas) or predicted (from the queue, while none reports)
    ttft_replicas: int = 0  # API replicas whose TTFT reports are fresh


class AdminClient:
    """Typed calls to one app; `admin_key` opens /admin, `api_key` /v1 (models)."""

    def __init__(self, url: str, admin_key: str | None, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._admin_key, self._api_key = admin_key, api_key
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ---- routes -------------------------------------------------------------------------------------
    def health(self) -> Health:
        """/health; a 503 (no healthy instance) is an answer, not an error."""
        return Health.model_validate(self._call("GET", "/health", auth="none", ok=(200, 503)))

    def models(self) -> list[ModelRow]:
        return [ModelRow.model_validate(m) for m in self._call("GET", "/v1/models", auth="api")["data"]]

    def instances(self) -> Instances:
        return Instances.model_validate(self._call("GET", "/admin/instances"))

    def migrations(self) -> Migrations:
        return Migrations.model_validate(self._call("GET", "/admin/migrations"))

    def autoscaler(self) -> Autoscaling:
        return Autoscaling.model_validate(self._call("GET", "/admin/autoscaler"))

    def dispatch(self) -> Dispatch:
        return Dispatch.model_validate(self._call("GET", "/admin/dispatch"))

    def requests(self, status: str | None = None) -> list[RequestRow]:
        params = {"status": status} if status else None
        return [RequestRow.model_validate(r) for r in self._call("GET", "/admin/requests", params=params)["requests"]]

    def abort(self, request_id: str) -> AbortResult:
        return AbortResult.model_validate(self._call("POST", f"/admin/requests/{request_id}/abort"))

    def drain(self, instance_id: str, abort: bool = False, migrate: bool = False) -> DrainResult:
        params = {"abort": "true"} if abort else {"migrate": "true"} if migrate else None
        return DrainResult.model_validate(self._call("POST", f"/admin/instances/{instance_id}/drain", params=params))

    def migrate(self, request_id: str, to: str | None = None) -> MigrateResult:
        params = {"to": to} if to else None
        return MigrateResult.model_validate(self._call("POST", f"/admin/requests/{request_id}/migrate", params=params))

    def undrain(self, instance_id: str) -> DrainResult:
        return DrainResult.model_validate(self._call("POST", f"/admin/instances/{instance_id}/undrain"))

    def routing(self, instance_id: str) -> bytes:
        """An expert-parallel instance's online routing statistics since the last call: a statistics file's bytes."""
        return self._send("GET", f"/admin/instances/{instance_id}/routing").content

    # ---- transport ----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, auth: Literal["admin", "api", "none"] = "admin",
              params: dict | None = None, ok: tuple[int, ...] = (200,)) -> dict:
        return _json(self._send(method, path, auth=auth, params=params, ok=ok))

    def _send(self, method: str, path: str, *, auth: Literal["admin", "api", "none"] = "admin",
              params: dict | None = None, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        key = {"admin": self._admin_key, "api": self._api_key, "none": None}[auth]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = self._http.request(method, path, headers=headers, params=params)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise AdminError(f"the specfleet app is not reachable at {self.url} ({type(e).__name__}: {e}); "
                             "start it with `specfleet serve`, or pass --url") from None
        except httpx.TimeoutException:
            raise AdminError(f"no answer from {self.url}{path} within {self._http.timeout.read}s") from None
        if r.status_code in ok:
            return r
        message = _error_message(r)
        if r.status_code == 401:
            raise AdminError(WRONG_ADMIN_KEY if path.startswith("/admin") else WRONG_API_KEY)
        if r.status_code >= 500:
            raise ServerError(f"{method} {path}: the app failed (HTTP {r.status_code}): {message}")
        raise AdminError(message if r.status_code == 404 else f"{method} {path}: HTTP {r.status_code}: {message}")


def _json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        raise ServerError(f"{r.request.url.path}: expected JSON, got {r.headers.get('content-type')!r}: "
                          f"{r.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise ServerError(f"{r.request.url.path}: expected a JSON object, got {type(body).__name__}")
    return body


def _error_message(r: httpx.Response) -> str:
    """The OpenAI-style error body's message, else the raw text (cut)."""
    try:
        body = r.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300] or r.reason_phrase
