"""The Serve application deployed with `specfleet serve` on the session's local cluster, over two tiny-model instances."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from deploy.infra import local_cluster
from tests.fixtures.tiny_models import DRAFT_NOISE, build_tiny_model, perturbed_copy

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
# keys with their own limits (serve.auth.keys), read from files: name -> (key, limits)
LIMITED_KEYS = {
    "hostile": ("sk-test-hostile", {"max_concurrent": 4, "tokens_per_minute": 600}),
    "narrow": ("sk-test-narrow", {"max_concurrent": 2}),
    "metered": ("sk-test-metered", {"tokens_per_minute": 200}),
    "vip": ("sk-test-vip", {"max_priority": 10}),
    "fuzz": ("sk-test-fuzz", {"max_concurrent": 2, "tokens_per_minute": 5000}),
}
BODY_TIMEOUT_S = 4.0
MODEL = "tiny-llama"
MAX_PENDING = 12
# the served model's context, and a streamed request that the CLI migrates or aborts mid-stream: the instances are
# held between two steps from its first chunks on (tests/serve/test_cli.py, `held`), so LONG need only outlast the
# moment between its first chunk and the pause
CONTEXT, LONG = 1024, 256


@dataclass(frozen=True)
class ServedApp:
    url: str
    grpc_target: str
    config_path: Path
    state_path: Path
    target: Path  # the tiny target model's folder (for reference outputs)

    def client(self, key: str | None = API_KEY, timeout: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specfleet(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = {**os.environ, **local_cluster.RAY_ENV}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def served_app(ray_cluster, tmp_path_factory) -> Iterator[ServedApp]:
    """`specfleet serve` of a config with a tiny llama pair of CONTEXT positions (k=3), two instances, keys (some
    with their own limits) and a small queue limit."""
    root = tmp_path_factory.mktemp("served-models")
    target = build_tiny_model("llama", root / "target", max_position_embeddings=CONTEXT)
    draft = perturbed_copy(target, root / "draft", DRAFT_NOISE)
    http_port, grpc_port = _free_port(), _free_port()
    keys_dir = tmp_path_factory.mktemp("keys")
    keys = []
    for name, (key, limits) in LIMITED_KEYS.items():
        (keys_dir / name).write_text(key + "\n")
        (keys_dir / name).chmod(0o600)  # a key file others can read is refused
        keys.append({"name": name, "key_file": str(keys_dir / name), **limits})
    config = {
        "engine": {"model": {"target": str(target), "draft": str(draft), "name": MODEL},
                   "speculation": {"policy": "fixed", "k": 3},
                   "scheduler": {"max_batch_size": 8},
                   "cache": {"block_size": 4, "num_blocks": 512, "prefix_caching": True}},
        "fleet": {"instances": 2, "instance_num_cpus": 0.5},
        "router": {"stats_interval_s": 0.2},
        "serve": {"http_port": http_port, "grpc_port": grpc_port, "max_pending_requests": MAX_PENDING,
                  "edge": {"body_timeout_s": BODY_TIMEOUT_S},
                  "auth": {"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY], "keys": keys}},
    }
    path = tmp_path_factory.mktemp("serve") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = specfleet("serve", "--config", str(path), "--state", str(ray_cluster.state_path), "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    app = ServedApp(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", path, ray_cluster.state_path, target)
    _wait_healthy(app, instances=2)
    yield app


def ports_of(app: ServedApp) -> tuple[int, int]:
    """The HTTP and gRPC ports `app` is served on."""
    return int(app.url.rsplit(":", 1)[1]), int(app.grpc_target.rsplit(":", 1)[1])


class _Displaced:
    """Whether another app holds the session app's ports: set while a module's app is served in its place (`None`),
    and once that module ends (its config path, for the next test that needs the session app to serve it again)."""

    app: ServedApp | None = None
    in_place = False


@contextmanager
def served_in_place_of(served_app: ServedApp, ray_cluster, config: dict, folder: Path, target: Path
                       ) -> Iterator[ServedApp]:
    """`specfleet serve` of `config` (on `served_app`'s ports: Serve's proxies keep the session's first ports) for
    the block, with one instance. The session's app is served again before the next test that asks for it
    (`_session_app_back`), not at the block's end: the modules that serve in place run last (`IN_PLACE_MODULES`), so
    the session's app is never served again for nobody."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    _Displaced.in_place = True
    out = specfleet("serve", "--config", str(path), "--state", str(ray_cluster.state_path), "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    http_port, grpc_port = ports_of(served_app)
    app = ServedApp(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", path, ray_cluster.state_path, target)
    _wait_healthy(app, instances=1)
    try:
        yield app
    finally:
        _Displaced.in_place, _Displaced.app = False, served_app


@pytest.fixture(autouse=True)
def _session_app_back(request: pytest.FixtureRequest) -> None:
    """The session's app served again on its ports before a test that uses it, if a module served another there."""
    app = _Displaced.app
    if app is None or _Displaced.in_place or "served_app" not in request.fixturenames:
        return
    out = specfleet("serve", "--config", str(app.config_path), "--state", str(app.state_path), "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    _wait_healthy(app, instances=2)
    _Displaced.app = None


# the modules that serve their own app on the session app's ports: run after every other test of the session
IN_PLACE_MODULES = ("test_autoscale.py", "test_tools.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests/serve modules in IN_PLACE_MODULES last (in their order), so the session's app is served once."""
    last = [i.path.parent.name == "serve" and i.path.name in IN_PLACE_MODULES for i in items]
    items[:] = [i for i, x in zip(items, last) if not x] + [i for i, x in zip(items, last) if x]


def _wait_healthy(app: ServedApp, instances: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{app.url}/health", timeout=10)
        if r.status_code == 200 and r.json()["healthy_instances"] == instances:
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)
