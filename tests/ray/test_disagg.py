"""Prefill/decode disaggregation on the real local cluster: a prefill and a decode instance of a tiny llama (fp32), a
router and the API's frontend in this process. A request prefills on one, moves after its first token (staged
migration, draft state included) and streams from the other; its output equals the aggregated run's at temperature 0,
with each draft kind, and nothing leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from actors.serving.server import InstanceServer
from cluster.config import (CacheConfig, EngineConfig, FleetConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpecfleetConfig, SpeculationConfig)
from cluster.disagg import DisaggConfig
from cluster.request import FinishReason
from cluster.router import Router
from deploy.cli.admin_client import Dispatch, Instances
from deploy.cli.admin_cmd import _disaggregation_line
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from placement.fleet import InstanceSpec
from tests.fixtures.tiny_models import build_tiny_model, perturbed_copy
from tests.ray.test_instance_server import CPUS, LAYOUTS
from tests.ray.test_migration import Fleet, held, kv_free, stream, wait_no_pending
from tests.unit.helpers import load, text_prompts

TOKENS = 200
ROLES = {"pd-prefill": "prefill", "pd-decode": "decode"}


def register(fleet: Fleet, roles: dict[str, str]) -> None:
    """(Re)register each instance with a role: registration is idempotent, and the role is what it reports."""
    for name, server in fleet.servers.items():
        info = ray.get(server.info.remote(), timeout=60)
        ray.get(fleet.router.register.remote(name, server, info.model, info.max_model_len, info.node_id,
                                             role=roles[name]))


@pytest.fixture(scope="module", params=["model", "ngram"], ids=["draft model", "n-gram"])
def fleet(request, ray_driver, tmp_path_factory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("pd-llama")
    target = build_tiny_model("llama", root / "target", max_position_embeddings=2048)
    draft = str(perturbed_copy(target, root / "draft", 0.02)) if request.param == "model" else None
    cfg = EngineConfig(model=ModelConfig(target=str(target), draft=draft, name="pd-llama", dtype="fp32"),
                       speculation=SpeculationConfig(method=request.param, policy="fixed", k=3),
                       scheduler=SchedulerConfig(max_batch_size=8), cache=CacheConfig(block_size=16, num_blocks=512))
    # every request is split (no prompt is short enough to skip the prefill instance)
    router_cfg = RouterConfig(stats_interval_s=0.2,
                              disaggregation=DisaggConfig(roles=tuple(ROLES.values()), skip_prefill_tokens=0))
    router = ray.remote(Router).options(max_concurrency=100, num_cpus=0).remote(router_cfg)
    fl = Fleet(router, Frontend(frontend_config(SpecfleetConfig(engine=cfg, fleet=FleetConfig(instances=2),
                                                                router=router_cfg)), router), cfg=cfg)
    try:
        for name in ROLES:
            spec = InstanceSpec(instance_id=name, layout=LAYOUTS["local"], executor="local", num_cpus=CPUS, engine=cfg)
            fl.servers[name] = InstanceServer.spawn(spec)
        yield fl
    finally:
        for server in fl.servers.values():
            ray.kill(server)
        ray.kill(router)


def test_a_disaggregated_request_gives_the_aggregated_output(fleet) -> None:
    prompts = text_prompts(load(fleet.cfg.model.target), 3, offset=2)
    register(fleet, {name: "both" for name in ROLES})
    aggregated = [asyncio.run(stream(fleet, p, tokens=TOKENS)) for p in prompts]
    assert ray.get(fleet.router.routing_stats.remote()).disaggregation == {}  # all `both`: plain dispatch

    register(fleet, ROLES)
    rows = {r.instance_id: r.role for r in ray.get(fleet.router.instances.remote())}
    assert rows == ROLES  # the role is what each registered with, as `specfleet instances` shows it

    async def handed_off(_rid: str, _instance: str) -> None:
        """After its first token: the prefill instance takes no step until the request has moved (a fast n-gram
        draft may otherwise finish 200 tokens before the move lands); the handoff's calls still run there."""
        before = sum((await fleet.router.routing_stats.remote()).handoffs.values())
        async with held(fleet, "pd-prefill"):
            for _ in range(600):
                if sum((await fleet.router.routing_stats.remote()).handoffs.values()) > before:
                    break
                await asyncio.sleep(0.1)
    split = [asyncio.run(stream(fleet, p, tokens=TOKENS, after=1, during=handed_off)) for p in prompts]

    for alone, moved in zip(aggregated, split):
        assert moved.error is None and moved.finish is FinishReason.LENGTH and len(moved.tokens) == TOKENS
        assert moved.instance == "pd-decode"  # where its stream ended: it followed the request there
        assert moved.tokens == alone.tokens and moved.text == alone.text  # no gap, no duplicate, same output
    routing = ray.get(fleet.router.routing_stats.remote())
    assert routing.disaggregation == {"disaggregated": len(prompts)}, routing
    assert routing.handoffs == {"finished": len(prompts)}, routing.handoffs  # each moved to the decode instance
    decoded = [r for r in ray.get(fleet.router.requests.remote()) if r.instance_id == "pd-decode"]
    assert len(decoded) >= len(prompts)  # the router's table followed them there
    # nothing leaks: the router's table and handoffs, and the KV blocks of both instances
    wait_no_pending(fleet)
    assert routing.handoffs_pending == 0 and ray.get(fleet.router.routing_stats.remote()).handoffs_pending == 0
    kv_free(fleet)
    # the figures: /metrics (as the API renders them from the router's rows and stats) and `specfleet status`'s line
    instances = ray.get(fleet.router.instances.remote())
    metrics = fleet.frontend.metrics
    metrics.set_instances(instances)
    metrics.routing_figures = routing
    text = metrics.render().decode()
    assert 'specfleet:instance_role{instance="pd-prefill",model_name="pd-llama",role="prefill"} 1.0' in text
    assert f'specfleet:disagg_placements_total{{reason="disaggregated"}} {len(prompts)}.0' in text
    assert f'specfleet:disagg_handoffs_total{{status="finished"}} {len(prompts)}.0' in text
    line = _disaggregation_line(Instances(instances=instances), Dispatch(**routing.as_dict()))
    assert line.startswith("disaggregation: 1 prefill, 1 decode, 0 both instance(s)") and "3 requests split" in line
