"""The router's request table reconciled against a real instance actor: releases that never arrive are healed."""

from __future__ import annotations

import asyncio
import time

import ray

from actors.serving.server import InstanceServer
from cluster.config import RouterConfig
from cluster.request import Request, RequestStatus, SamplingParams
from cluster.router import Router
from placement.fleet import InstanceSpec
from tests.ray.test_instance_server import CPUS, LAYOUTS, collect, engine_config
from tests.unit.helpers import load, text_prompts


def wait_status(router, rid: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        [row] = [r for r in ray.get(router.requests.remote(), timeout=30) if r.request_id == rid]
        if row.status != "running" or time.monotonic() > deadline:
            return row.status
        time.sleep(0.1)


def test_requests_whose_release_never_arrives_are_closed_with_the_instances_status(ray_driver, tiny_models,
                                                                                   tiny_draft_models) -> None:
    server = InstanceServer.spawn(InstanceSpec(instance_id="reconcile-inst", layout=LAYOUTS["local"], executor="local",
                                               num_cpus=CPUS,
                                               engine=engine_config(tiny_models["llama"], tiny_draft_models["llama"])))
    router = ray.remote(Router).options(max_concurrency=100, num_cpus=0).remote(
        RouterConfig(stats_interval_s=0.1, orphan_grace_s=3.0))
    try:
        info = ray.get(server.info.remote(), timeout=300)
        ray.get(router.register.remote("reconcile-inst", server, info.model, info.max_model_len, info.node_id))
        prompt = tuple(text_prompts(load(tiny_models["llama"]), 1, offset=11)[0])
        for rid in ("finished", "cut", "orphan"):
            assert ray.get(router.route.remote(rid))[0] == "reconcile-inst"
        routed_at = time.monotonic()
        time.sleep(0.5)  # several polls: a request the instance has not received yet may be on its way
        assert {r.status for r in ray.get(router.requests.remote())} == {"running"}
        # ran to its end at the instance, but the API's `finish` never came
        items = asyncio.run(collect(server, Request("finished", prompt, SamplingParams(temperature=0, max_tokens=8))))
        assert items[-1].delta.finished
        # aborted at the instance (its consumer went away), and again no `finish`
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        asyncio.run(collect(server, Request("cut", prompt, long), stop_after=2))
        assert wait_status(router, "finished") == "finished"
        assert wait_status(router, "cut") == "aborted"
        # never sent: closed only after the grace
        assert wait_status(router, "orphan") == "aborted" and time.monotonic() - routed_at >= 3.0
        assert ray.get(router.pending.remote()) == 0
        assert ray.get(server.kv_blocks_used.remote()) == (0, 0)
    finally:
        ray.kill(router)
        ray.get(server.shutdown.remote(), timeout=60)
        ray.kill(server)
