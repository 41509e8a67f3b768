"""The Instance facade (actors/serving/instance.py): a shard failure during a migration's operation fails the instance the way
one during a step does, and the serving loop delivers the error deltas of every request in flight."""

from __future__ import annotations

import pytest

from actors.serving.build import local_instance
from actors.executors.protocol import ShardFailure
from actors.serving.instance import Instance, InstanceUnhealthy
from actors.serving.loop import ServingLoop, StepBarrier
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.migration_messages import Pipeline
from cluster.request import FinishReason, Request, SamplingParams
from tests.unit.helpers import load, text_prompts
from tests.unit.test_serving import Collector

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def two_stages(tiny_models, tiny_draft_models) -> Instance:
    """The tiny llama as two stages in this process (layers 0-1, 2-3), its perturbed copy as draft (k = 3)."""
    cfg = EngineConfig(model=ModelConfig(target=str(tiny_models["llama"]), draft=str(tiny_draft_models["llama"])),
                       speculation=SpeculationConfig(policy="fixed", k=3), scheduler=SchedulerConfig(max_batch_size=4),
                       cache=CacheConfig(block_size=4, num_blocks=256))
    return local_instance(cfg, [(0, 2), (2, 4)])


@pytest.mark.parametrize("operation", ["export target", "stop_out", "export draft"])
def test_a_shard_failure_during_a_migration_fails_the_instance_as_in_a_step(tiny_models, tiny_draft_models,
                                                                           operation) -> None:
    inst = two_stages(tiny_models, tiny_draft_models)
    prompts = text_prompts(load(tiny_models["llama"]), 2, offset=2)
    for i, p in enumerate(prompts):
        inst.add_request(Request(f"r{i}", tuple(p), GREEDY))
    for _ in range(3):
        assert all(d.finish_reason is None for d in inst.step())
    held = inst.kv_length("r0")
    assert held is not None and held > 0
    inst.target.executor.kill([1])
    inst.draft.executor.kill()

    with pytest.raises(ShardFailure) as failure:
        if operation == "export target":
            inst.export(Pipeline.TARGET, "r0", 0, held)
        elif operation == "stop_out":
            inst.stop_out("r0", 0)
        else:
            inst.export(Pipeline.DRAFT, "r0", 0, held)

    health = inst.health()
    assert not health.healthy and health.error == str(failure.value)
    assert inst.has_unfinished()  # the error deltas go out with the next step
    deltas = inst.step()
    assert sorted(d.request_id for d in deltas) == ["r0", "r1"]
    assert all(d.finish_reason is FinishReason.ERROR and d.instance_failure and health.error in d.error
               for d in deltas)
    assert not inst.has_unfinished() and inst.step() == [] and inst.kv_blocks_used() == (0, 0)
    with pytest.raises(InstanceUnhealthy):
        inst.add_request(Request("late", tuple(prompts[0]), GREEDY))


def test_the_serving_loop_ends_every_stream_when_a_migrations_export_loses_a_shard(tiny_models,
                                                                                  tiny_draft_models) -> None:
    inst = two_stages(tiny_models, tiny_draft_models)
    barrier = StepBarrier(after=2, timeout_s=30)
    loop, got = ServingLoop(inst, between_steps=barrier), Collector()
    prompts = text_prompts(load(tiny_models["llama"]), 2, offset=4)
    try:
        # both requests are taken while the loop is paused, so both are in flight at step 2 whatever the scheduler
        # does: submitted one after the other, a descheduled test thread could post r1 after step 2 had begun, and
        # the held barrier would then keep r1's submit from ever being applied
        loop.pause(60).result(30)
        taken = [loop.submit(Request(f"r{i}", tuple(p), GREEDY), got.sink(f"r{i}")) for i, p in enumerate(prompts)]
        loop.resume()
        for fut in taken:
            fut.result(30)
        assert barrier.reached.wait(30)
        inst.target.executor.kill([0])
        export = loop.call(lambda: inst.export(Pipeline.TARGET, "r0", 0, 10_000))  # applied before step 3
        barrier.release()
        with pytest.raises(ShardFailure):
            export.result(30)
        for rid in ("r0", "r1"):
            final = got.wait(rid, 30)[-1].delta
            assert final.finish_reason is FinishReason.ERROR and final.instance_failure, final
        assert loop.alive and not inst.health().healthy and inst.kv_blocks_used() == (0, 0)
    finally:
        loop.close()
        inst.shutdown()
