"""The serving actor on the real local cluster: streams, cancellation, and a pipeline-split instance behind it."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from actors.serving.server import InstanceServer
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot
from tests.unit.helpers import load, reference_greedy, text_prompts

CPUS = 0.5
LAYOUTS = {  # the whole tiny model beside its draft on one device, run in the actor; or 2 stages and a draft actor
    "local": ShardLayout(stages=(StageSlot(node="a100", layers=(0, 4)),), draft_node="a100"),
    "ray": ShardLayout(stages=(StageSlot(node="a100", layers=(0, 2)), StageSlot(node="l4-0", layers=(2, 4))),
                       draft_node="l4-1"),
}


def engine_config(target, draft) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)),
                        speculation=SpeculationConfig(policy="fixed", k=3), scheduler=SchedulerConfig(max_batch_size=4),
                        cache=CacheConfig(block_size=4, num_blocks=256))


async def collect(server, request: Request, stop_after: int | None = None) -> list:
    """The request's StreamItems; with `stop_after`, stop consuming (cancel) after that many."""
    items = []
    gen = server.generate.options(num_returns="streaming").remote(request)
    async for ref in gen:
        items.append(await ref)
        if stop_after is not None and len(items) == stop_after:
            ray.cancel(gen)
            break
    return items


@pytest.fixture(scope="module", params=["local", "ray"], ids=["stages in process", "stage actors"])
def server(request, ray_driver, tiny_models, tiny_draft_models):
    layout = LAYOUTS[request.param]
    spec = InstanceSpec(instance_id=f"test-{request.param}", layout=layout, executor=request.param, num_cpus=CPUS,
                        engine=engine_config(tiny_models["llama"], tiny_draft_models["llama"]))
    handle = InstanceServer.spawn(spec)
    info = ray.get(handle.info.remote(), timeout=300)
    assert info.num_stages == len(layout.stages) and info.has_draft
    # the path its target runs on and why, whichever executor holds the weights (the router shows it in status)
    # and how it computes: dtype, device and which CPU kernels (the build this CPU runs, or torch's ops) and why
    path, compute = info.backend.split("; ")
    assert path == "native path (hand-written layers for llama)", info.backend
    assert compute.startswith("fp32 on the CPU, ") and ("kernels (" in compute or "torch ops (" in compute), compute
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.kill(handle)


def test_concurrent_streams_give_the_targets_greedy_output(server, tiny_models) -> None:
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=30)
    requests = [Request(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=16)) for i, p in enumerate(prompts)]

    async def run_all():
        return await asyncio.gather(*(collect(server, r) for r in requests))

    for prompt, items in zip(prompts, asyncio.run(run_all())):
        assert [t for it in items for t in it.delta.token_ids] == reference_greedy(tiny_models["llama"], prompt, 16)
        assert items[-1].delta.finished and items[-1].stats.proposed > 0
    assert ray.get(server.kv_blocks_used.remote()) == (0, 0)
    assert ray.get(server.health.remote()).healthy


def test_a_consumer_that_goes_away_aborts_its_request_and_frees_kv(server, tiny_models) -> None:
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=2)[0]
    request = Request("gone", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    emitted_before = ray.get(server.stats.remote()).step.tokens_emitted
    items = asyncio.run(collect(server, request, stop_after=2))
    assert len(items) == 2 and not items[-1].delta.finished
    deadline = time.monotonic() + 30
    while ray.get(server.kv_blocks_used.remote()) != (0, 0):
        assert time.monotonic() < deadline, "the cancelled request still holds KV"
        time.sleep(0.1)
    assert ray.get(server.abort.remote("gone")) is False  # already gone
    assert ray.get(server.stats.remote()).step.tokens_emitted - emitted_before < 150  # stopped well before its 200


def test_a_request_the_engine_refuses_comes_back_as_one_rejected_item(server) -> None:
    items = asyncio.run(collect(server, Request("empty", (), SamplingParams(max_tokens=4))))
    assert len(items) == 1 and items[0].rejected and items[0].delta.finish_reason == FinishReason.ERROR
    assert "empty" in items[0].delta.error
