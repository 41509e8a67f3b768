"""The fleet planned once, as `build_app` plans it, on the local cluster whose first three nodes hold four devices.

Two instances of two pipeline stages each: their stages sit on four distinct (node, device) pairs, every shard
actor runs on the node its plan names, and both instances serve the target's greedy output.
"""

from __future__ import annotations

import asyncio

import ray
from ray._private import state as ray_state

from actors.serving.server import InstanceServer
from cluster.config import parse_config
from cluster.request import Request, SamplingParams
from deploy.serve.fleet import fleet_specs
from tests.unit.helpers import load, reference_greedy, text_prompts

NEW_TOKENS = 12


def test_two_instances_of_two_stages_on_four_devices_as_planned(ray_driver, tiny_models, tiny_draft_models) -> None:
    cfg = parse_config({
        "engine": {"model": {"target": str(tiny_models["llama"]), "draft": str(tiny_draft_models["llama"])},
                   "speculation": {"policy": "fixed", "k": 3}, "scheduler": {"max_batch_size": 4},
                   "cache": {"block_size": 4, "num_blocks": 128}},
        "fleet": {"instances": 2, "pipeline_stages": 2, "instance_num_cpus": 0.5},
    })
    specs = fleet_specs(cfg)  # the cluster's inventory, read from its nodes' labels

    stages = [(s.node, s.device) for spec in specs for s in spec.layout.stages]
    assert sorted(stages) == [("a100", 0), ("a100", 1), ("l4-0", 0), ("l4-1", 0)]
    servers = [InstanceServer.spawn(spec) for spec in specs]
    try:
        infos = ray.get([s.info.remote() for s in servers], timeout=300)
        assert [i.num_stages for i in infos] == [2, 2] and all(i.has_draft for i in infos)

        node_ids = {n["NodeName"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        where = {a: info["Address"]["NodeID"] for a, info in ray_state.actors(actor_state_name="ALIVE").items()}
        for spec in specs:
            names = [f"{spec.instance_id}/stage-{i}" for i in range(2)] + [f"{spec.instance_id}/draft"]
            planned = [s.node for s in spec.layout.stages] + [spec.layout.draft_node]
            actors = [ray.get_actor(n) for n in names]
            assert [where[a._actor_id.hex()] for a in actors] == [node_ids[n] for n in planned]

        prompts = text_prompts(load(tiny_models["llama"]), 4, offset=20)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

        async def stream(server, rid: str, prompt: list[int]) -> list[int]:
            tokens = []
            async for ref in server.generate.options(num_returns="streaming").remote(Request(rid, tuple(prompt), greedy)):
                tokens.extend((await ref).delta.token_ids)
            return tokens

        async def run_all():
            return await asyncio.gather(*(stream(servers[i % 2], f"r{i}", p) for i, p in enumerate(prompts)))

        for prompt, tokens in zip(prompts, asyncio.run(run_all())):
            assert tokens == reference_greedy(tiny_models["llama"], prompt, NEW_TOKENS)
    finally:
        for s in servers:
            ray.get(s.shutdown.remote(), timeout=60)
            ray.kill(s)
