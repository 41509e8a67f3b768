"""`router.autoscaling` in the served app: the autoscaler deployment adds an instance under a load over HTTP and
drains it through migration once the load falls; every stream completes with the unscaled run's text (temperature 0),
none fails over, and the steps with their reasons show in /admin/autoscaler, /metrics and `specfleet status`. The
TTFT the autoscaler reads is the one the API replica measured (pushed to it every round), and says so."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.tiny_models import DRAFT_NOISE, build_tiny_model, perturbed_copy
from tests.serve.conftest import ADMIN_KEY, API_KEY, ServedApp, ports_of, served_in_place_of, specfleet

MODEL = "tiny-elastic"
TOKENS = 120
PROMPTS = [f"Tell me about the number {n} and why it matters." for n in range(8)]


@pytest.fixture(scope="module")
def elastic_app(served_app, ray_cluster, tmp_path_factory) -> Iterator[ServedApp]:
    """`specfleet serve` with autoscaling between 1 and 2 instances of 2 slots, on the ports of the session's app
    (Serve's proxies keep the first app's); a later test that needs the session's app serves it again."""
    root = tmp_path_factory.mktemp("elastic-models")
    target = build_tiny_model("llama", root / "target", max_position_embeddings=1024)
    draft = perturbed_copy(target, root / "draft", DRAFT_NOISE)
    http_port, grpc_port = ports_of(served_app)
    config = {
        "engine": {"model": {"target": str(target), "draft": str(draft), "name": MODEL},
                   "speculation": {"policy": "fixed", "k": 3}, "scheduler": {"max_batch_size": 2},
                   "cache": {"block_size": 4, "num_blocks": 512}},
        "fleet": {"instance_num_cpus": 0.5,
                  "autoscaling": {"min_instances": 1, "max_instances": 2, "up_after_s": 0, "down_after_s": 2,
                                  "cooldown_s": 0, "interval_s": 0.5, "window_s": 10,
                                  "target": {"queue_per_instance": 1}}},
        "router": {"stats_interval_s": 0.2},
        "serve": {"http_port": http_port, "grpc_port": grpc_port,
                  "auth": {"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]}},
    }
    with served_in_place_of(served_app, ray_cluster, config, tmp_path_factory.mktemp("elastic-serve"), target) as app:
        yield app


def complete(app: ServedApp, prompt: str, timed: list[float] | None = None, tokens: int = TOKENS) -> str:
    """A streamed completion's text, at temperature 0, to its length limit; `timed` gets its TTFT as the client saw
    it (from sending the request to the first text)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = "", None
    with app.client() as c:
        sent = time.monotonic()
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    if timed is not None and choice["text"] and not text:
                        timed.append(time.monotonic() - sent)
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
    assert finish == "length", (finish, text)
    return text


def autoscaler(app: ServedApp) -> dict:
    with app.client(ADMIN_KEY) as c:
        r = c.get("/admin/autoscaler")
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(app: ServedApp, ready, timeout_s: float = 60.0) -> dict:
    """The autoscaler's status once `ready(status)` holds."""
    deadline = time.monotonic() + timeout_s
    while not ready(status := autoscaler(app)):
        assert time.monotonic() < deadline, status
        time.sleep(0.25)
    return status


def wait_for_step(app: ServedApp, action: str, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = autoscaler(app)
        done = [e for e in status["events"] if e["action"] == action]
        if done:
            return done[0]
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_the_fleet_grows_under_load_and_shrinks_after_without_losing_a_stream(elastic_app: ServedApp) -> None:
    app = elastic_app
    status = autoscaler(app)
    assert status["enabled"] and (status["min_instances"], status["max_instances"]) == (1, 2)
    unscaled = [complete(app, p) for p in PROMPTS[:2]]  # one at a time: no queue, no step
    assert autoscaler(app)["events"] == []
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        first = [pool.submit(complete, app, p) for p in PROMPTS[:4]]  # 2 queued on 2 slots: above the target of 1
        up = wait_for_step(app, "up")
        assert up["outcome"] == "done" and "queue" in up["reason"], up
        second = [pool.submit(complete, app, p) for p in PROMPTS[4:]]
        texts = [f.result(timeout=600) for f in first + second]
    down = wait_for_step(app, "down")  # the load gone: the added instance leaves through a migrating drain
    assert (down["instance_id"], down["outcome"], down["detail"]) == (up["instance_id"], "done", ""), down
    assert texts[:2] == unscaled  # the same text as the unscaled run, token for token
    alone = [complete(app, p) for p in PROMPTS[2:]]  # the fleet back at its floor
    assert texts[2:] == alone

    with app.client(ADMIN_KEY) as c:
        assert c.get("/admin/migrations").json()["failovers"] == 0  # nothing restarted
        rows = c.get("/admin/instances").json()["instances"]
    assert [r["instance_id"] for r in rows] == [r["instance_id"] for r in rows if not r["instance_id"].startswith(
        "auto-")] and len(rows) == 1
    metrics = httpx.get(f"{app.url}/metrics", timeout=30).text
    assert 'specfleet:autoscaling_scale_events_total{action="up",cause="queue",outcome="done"} 1.0' in metrics
    assert 'specfleet:autoscaling_scale_events_total{action="down",cause="low_load",outcome="done"} 1.0' in metrics
    assert "specfleet:autoscaling_current_instances 1.0" in metrics
    # no background round failed (a defect failing every round would show here, not only in a log)
    assert "specfleet:autoscaling_failed_rounds_total 0.0" in metrics
    for loop in ("migration_plan", "handoff", "health_poll"):
        assert f'specfleet:router_failed_rounds_total{{loop="{loop}"}} 0.0' in metrics, loop
    out = specfleet("status", "--config", str(app.config_path), "--state", str(app.state_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "autoscaling: 1 instance(s) within 1-2; 2 step(s)" in out.stdout, out.stdout
    assert f"last step: down {up['instance_id']} done" in out.stdout, out.stdout
    assert "WARNING" not in out.stdout, out.stdout


def test_the_autoscaler_reads_the_ttft_the_api_replica_measured(elastic_app: ServedApp) -> None:
    """Once the window (10 s) holds no first token, the autoscaler has no TTFT; after one short request its p99 is
    that request's first-token latency as the API replica measured it (within what the client saw), said to be
    measured, from the one API replica: it was pushed to the autoscaler, not predicted from the queue."""
    app = elastic_app
    wait_for(app, lambda s: s["ttft_source"] is None and s["ttft_p99_s"] is None)  # earlier requests out of it
    seen: list[float] = []
    complete(app, PROMPTS[0], seen, tokens=4)  # done well within the window: its first token is still in it
    status = wait_for(app, lambda s: s["ttft_source"] == "measured")  # the replica's next push (every 0.5 s)
    assert status["ttft_replicas"] == 1, status
    # the replica's value (a sample, or the request's age while it waited) lies within what the client saw
    assert 0.0 < status["ttft_p99_s"] <= seen[0], (status, seen)
    metrics = httpx.get(f"{app.url}/metrics", timeout=30).text
    assert 'specfleet:autoscaling_ttft_source_info{source="measured"} 1.0' in metrics
    out = specfleet("status", "--config", str(app.config_path), "--state", str(app.state_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(measured from 1 API replica(s))" in out.stdout, out.stdout
