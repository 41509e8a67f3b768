"""One Instance, two executors: its stages in this process (LocalStages) or in shard actors (RayStages).

The same requests give the same (the target's greedy) output in both shapes, and a stopped stage turns either
instance unhealthy the same way: every request in flight ends with an error naming the stage, none hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from actors.serving.build import ray_instance
from actors.serving.instance import Instance, InstanceUnhealthy
from actors.serving.build import local_instance
from actors.serving.loop import ServingLoop
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams, StreamItem
from placement.layout import ShardLayout, StageSlot
from tests.unit.helpers import load, reference_greedy, text_prompts

LAYOUT = ShardLayout(stages=(StageSlot(node="a100", layers=(0, 2)), StageSlot(node="l4-0", layers=(2, 4))),
                     draft_node="l4-1")
STAGE_NAMES = {"local": "stage 1 (in process)", "ray": "stage 1 on l4-0"}


def engine_config(target, draft) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)),
                        speculation=SpeculationConfig(policy="fixed", k=3), scheduler=SchedulerConfig(max_batch_size=4),
                        cache=CacheConfig(block_size=4, num_blocks=256))


@pytest.fixture(params=["local", "ray"])
def instance(request, ray_driver, tiny_models, tiny_draft_models) -> Iterator[tuple[str, Instance]]:
    cfg = engine_config(tiny_models["llama"], tiny_draft_models["llama"])
    stages = [s.layers for s in LAYOUT.stages]
    inst = (local_instance(cfg, stages) if request.param == "local" else
            ray_instance(cfg, LAYOUT, num_cpus=0.5, ready_timeout_s=180, step_timeout_s=20, group_timeout_s=20))
    try:
        yield request.param, inst
    finally:
        inst.shutdown()


class Streams:
    """Per-request sinks for a ServingLoop; `wait` returns a request's items once its final one arrived."""

    def __init__(self) -> None:
        self.items: dict[str, list[StreamItem]] = {}
        self.done: dict[str, threading.Event] = {}

    def sink(self, rid: str):
        self.items[rid], self.done[rid] = [], threading.Event()

        def put(item: StreamItem) -> None:
            self.items[rid].append(item)
            if item.delta.finished:
                self.done[rid].set()
        return put

    def wait(self, rid: str, timeout_s: float) -> list[StreamItem]:
        assert self.done[rid].wait(timeout_s), f"{rid} did not end within {timeout_s} s"
        return self.items[rid]


def test_both_executors_serve_the_targets_greedy_output_and_fail_alike(instance, tiny_models) -> None:
    shape, inst = instance
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=10)
    loop, streams = ServingLoop(inst, name=f"loop-{shape}"), Streams()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        for i, p in enumerate(prompts):
            loop.submit(Request(f"r{i}", tuple(p), greedy), streams.sink(f"r{i}")).result(60)
        for i, p in enumerate(prompts):
            items = streams.wait(f"r{i}", 120)
            assert [t for it in items for t in it.delta.token_ids] == reference_greedy(tiny_models["llama"], p, 16)
        usage = inst.shard_cache_usage()  # the loop is idle: every request ended
        assert [used for used, _ in usage["target"] + usage["draft"]] == [0, 0, 0]

        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        ids = [f"long{i}" for i in range(3)]
        for rid, p in zip(ids, prompts):
            loop.submit(Request(rid, tuple(p), long), streams.sink(rid)).result(60)
        for rid in ids:  # every request is running and has produced tokens
            while not streams.items[rid]:
                assert not streams.done[rid].is_set()
                threading.Event().wait(0.02)

        inst.target.executor.kill([1])

        for rid in ids:
            final = streams.wait(rid, 30)[-1].delta
            assert final.finish_reason == FinishReason.ERROR and STAGE_NAMES[shape] in final.error, final
            assert sum(len(it.delta.token_ids) for it in streams.items[rid]) < 200
        health = inst.health()
        assert not health.healthy and STAGE_NAMES[shape] in health.error
        with pytest.raises(InstanceUnhealthy):
            loop.submit(Request("late", tuple(prompts[0]), greedy), streams.sink("late")).result(10)
        assert loop.alive and inst.kv_blocks_used() == (0, 0)
    finally:
        loop.close()
