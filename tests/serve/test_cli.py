"""The operator's CLI (status, instances, requests, abort, drain) and `bench serve` against the real served app.

Commands whose exit status and output end to end matter run as `python -m deploy.cli` subprocesses; the quick
admin calls (and the abort, which races a running request) call `deploy.cli.main` in this process.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from cluster.router import INSTANCE_ACTOR_PREFIX, NAMESPACE
from tests.fixtures.cli import run_cli
from tests.serve.conftest import LONG, MODEL, ServedApp, specfleet

WRONG_KEY = "sk-definitely-wrong-4242"
HOLD_S = 120.0  # the longest `held` keeps the instances paused, should a test fail inside it


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPECFLEET_ADMIN_KEYS", "SPECFLEET_API_KEYS"):
        monkeypatch.delenv(name, raising=False)


def cli(app: ServedApp, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`specfleet ARGS --config <the app's config>` in this process: (exit status, stdout, stderr)."""
    return run_cli(capsys, *args, "--config", app.config_path)


def test_instances_and_requests(served_app: ServedApp, capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = cli(served_app, capsys, "instances", "--json")
    assert rc == 0
    rows = json.loads(out)["instances"]
    assert len(rows) == 2 and all(r["healthy"] and not r["draining"] and r["model"] == MODEL for r in rows)
    assert all(r["stats"] is not None and r["stats"]["kv_blocks_free"] > 0 for r in rows)
    assert all(r["backend"].startswith("native path (hand-written layers for ") for r in rows), rows
    places = [{(p["node"], p["device"]) for p in [*r["place"]["stages"], r["place"]["draft"]]} for r in rows]
    assert all(r["place"]["stages"][0]["layers"][0] == 0 for r in rows) and not places[0] & places[1]

    rc, out, _ = cli(served_app, capsys, "instances")
    assert rc == 0 and all(r["instance_id"] in out for r in rows) and "KV USED" in out and "place: a100:" in out

    with served_app.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
    rc, out, _ = cli(served_app, capsys, "requests", "--status", "finished", "--json")
    assert rc == 0
    assert r.json()["id"] in {row["request_id"] for row in json.loads(out)["requests"]}


def test_status(served_app: ServedApp) -> None:
    out = specfleet("status", "--json", "--config", str(served_app.config_path), "--state", str(served_app.state_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["healthy"] and report["health"]["healthy_instances"] == 2 and len(report["instances"]) == 2
    assert len(report["nodes"]) == 3 and all(n["alive"] for n in report["nodes"])
    assert {"running", "waiting", "pending", "kv_blocks_used", "acceptance", "mean_k"} <= set(report["load"])
    wait = report["migrations"]["failover_wait"]  # learned from the instances' starts (cluster/start_times.py)
    assert wait["samples"] >= 1 and wait["slowest_s"] > 0 and wait["floor_s"] <= wait["wait_s"] <= wait["ceiling_s"]
    text = specfleet("status", "--config", str(served_app.config_path), "--state", str(served_app.state_path))
    assert text.returncode == 0 and "the router holds 0 pending" in text.stdout, text.stdout + text.stderr
    assert "failover: with no instance up a request waits up to" in text.stdout, text.stdout
    assert all(f"{i['instance_id']} model: native path (hand-written layers for " in text.stdout
               for i in report["instances"]), text.stdout


def stream_in_background(app: ServedApp, body: dict, begun: threading.Event | None = None
                         ) -> tuple[threading.Thread, list[tuple[str, str | None]]]:
    """A streamed completion in a thread; `begun` is set once its first text arrived (or it ended); once it ends, its
    (text, finish reason) is in the list."""
    got: list[tuple[str, str | None]] = []
    begun = begun or threading.Event()

    def stream() -> None:
        text, reason = "", None
        try:
            with app.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices", []):
                            text += choice["text"]
                            reason = choice["finish_reason"] or reason
                        if text:
                            begun.set()
            got.append((text, reason))
        finally:
            begun.set()

    t = threading.Thread(target=stream)
    t.start()
    return t, got


@contextlib.contextmanager
def held(begun: threading.Event, timeout_s: float = 60.0) -> Iterator[None]:
    """Once a stream has begun (its first text arrived), every instance of the app takes no step until the block
    ends (InstanceServer.pause; what is posted to them, an abort or a migration, still applies): a stream held there
    cannot end before the event the block places, however long the CLI takes (rather than a stream made long enough
    to outlast it). This process is a Ray driver of the app's cluster (`ray_driver`)."""
    actors = [ray.get_actor(a["name"], namespace=NAMESPACE) for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == NAMESPACE and a["name"].startswith(INSTANCE_ACTOR_PREFIX)]
    assert actors, "no instance actor of the app found"
    assert begun.wait(timeout_s), "the stream never began"
    ray.get([a.pause.remote(HOLD_S) for a in actors], timeout=timeout_s)
    try:
        yield
    finally:
        ray.get([a.resume.remote() for a in actors], timeout=timeout_s)


def wait_running(app: ServedApp, capsys: pytest.CaptureFixture, got: list) -> list[dict]:
    """The router's running requests, once there are some (empty if the stream ended first)."""
    deadline = time.monotonic() + 30
    running: list[dict] = []
    while not running and not got:
        assert time.monotonic() < deadline, "the request never showed up as running"
        rc, out, _ = cli(app, capsys, "requests", "--status", "running", "--json")
        assert rc == 0
        running = json.loads(out)["requests"]
    return running


def test_abort_a_running_request(served_app: ServedApp, ray_driver, capsys: pytest.CaptureFixture) -> None:
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": LONG, "ignore_eos": True}
    begun = threading.Event()
    t, got = stream_in_background(served_app, body, begun)
    with held(begun):
        running = wait_running(served_app, capsys, got)
        assert running, f"the request finished ({got}) before it could be aborted"
        rc, out, err = cli(served_app, capsys, "abort", running[0]["request_id"])
        assert rc == 0, err
    t.join(timeout=30)
    assert [reason for _, reason in got] == ["abort"]
    rc, out, err = cli(served_app, capsys, "abort", running[0]["request_id"])
    assert rc == 2 and "no running request" in err


def test_migrate_a_running_request(served_app: ServedApp, ray_driver, capsys: pytest.CaptureFixture) -> None:
    """`specfleet migrate` moves a streaming request between two pipeline instances mid-stream: the client's text is
    the unmigrated run's, and the migration shows in `status` and /metrics."""
    body = {"model": MODEL, "prompt": "the migrating tale", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    with served_app.client() as c:
        alone = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    begun = threading.Event()
    t, got = stream_in_background(served_app, body, begun)
    with held(begun):
        running = wait_running(served_app, capsys, got)
        assert running, "the request finished before it could be migrated"
        rc, out, err = cli(served_app, capsys, "migrate", running[0]["request_id"], "--json")
    t.join(timeout=60)
    assert rc == 0 and json.loads(out)["status"] == "finished", out + err
    assert got == [(alone, "length")]
    _, out, _ = cli(served_app, capsys, "requests", "--status", "finished", "--json")
    row = next(r for r in json.loads(out)["requests"] if r["request_id"] == running[0]["request_id"])
    assert row["instance_id"] != running[0]["instance_id"]  # the router's table followed the request
    report = json.loads(specfleet("status", "--json", "--config", str(served_app.config_path)).stdout)
    assert report["migrations"]["by_status"]["finished"] >= 1 and report["migrations"]["downtime_max_s"] > 0
    assert 'specfleet:migrations_total{status="finished"}' in httpx.get(f"{served_app.url}/metrics").text
    rc, _, err = cli(served_app, capsys, "migrate", "cmpl-nope")
    assert rc == 2 and "no running request" in err and "Traceback" not in err, err
    rc, _, err = cli(served_app, capsys, "migrate", running[0]["request_id"])  # it has ended
    assert rc == 2 and "no running request" in err, err


def test_drain_and_undrain(served_app: ServedApp, capsys: pytest.CaptureFixture) -> None:
    _, out, _ = cli(served_app, capsys, "instances", "--json")
    victim = json.loads(out)["instances"][0]["instance_id"]
    rc, out, err = cli(served_app, capsys, "drain", victim, "--json")
    try:
        assert rc == 0 and json.loads(out)["draining"], err
        assert httpx.get(f"{served_app.url}/health").json()["healthy_instances"] == 1
    finally:
        rc, _, err = cli(served_app, capsys, "undrain", victim)
    assert rc == 0, err
    assert httpx.get(f"{served_app.url}/health").json()["healthy_instances"] == 2
    rc, _, err = cli(served_app, capsys, "drain", "inst-nope")
    assert rc == 2 and "inst-nope" in err


def test_wrong_admin_key_and_unreachable_app(served_app: ServedApp, capsys: pytest.CaptureFixture) -> None:
    out = specfleet("instances", "--config", str(served_app.config_path), "--admin-key", WRONG_KEY)
    assert out.returncode == 2
    assert "wrong admin key" in out.stderr and WRONG_KEY not in out.stdout + out.stderr
    rc, out, err = cli(served_app, capsys, "requests", "--url", "http://127.0.0.1:9")
    assert rc == 2 and "not reachable at http://127.0.0.1:9" in err and "specfleet serve" in err


def test_bench_serve(served_app: ServedApp, tmp_path: Path) -> None:
    report_path, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    out = specfleet("bench", "serve", "--config", str(served_app.config_path), "--state", str(served_app.state_path),
                    "--rates", "4", "--duration", "2", "--max-tokens", "8", "--max-prompt-tokens", "64",
                    "--overhead-requests", "4", "--concurrency", "10", "--json", str(report_path), "--plot", str(plot),
                    timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    assert report["model"] == MODEL and plot.stat().st_size > 0
    assert report["concurrency"]["completed"] == 10 and report["concurrency"]["lost"] == 0
    o = report["overhead"]
    assert o["requests"] == 4 and isinstance(o["overhead_e2e_p50_ms"], float)
    local = report["in_process"]  # the same instance in the bench's process, beside the served one
    assert local["requests"] == 4 and 0 < local["ttft_p50_ms"] <= local["e2e_p50_ms"]
    assert "in one process" in out.stdout
    run = report["runs"][0]
    assert run["rate"] == 4 and run["errors"] == 0 and run["completed"] == run["requests"] >= 1
    assert {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s"} <= set(run)
