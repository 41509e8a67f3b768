"""EasySpec across Ray actors: the draft's layer groups run on member actors beside the target stages, over gloo."""

from __future__ import annotations

import pytest
import ray
from ray._private import state as ray_state

from actors.serving.build import draft_group_runner, ray_instance
from actors.engine.core import Engine
from actors.serving.build import local_instance
from actors.engine.offline import generate
from cluster.config import DraftParallelConfig
from cluster.request import SamplingParams
from tests.ray.test_pipeline_instance import CACHE, CPUS, NEW_TOKENS, TWO_STAGES, engine_config
from tests.unit.helpers import load, reference_greedy, runner, text_prompts

SETTINGS = [(2, "attention"), (3, "layer")]  # each group size and each mode once (a setting is ~11 s of Ray actors)


@pytest.mark.parametrize(("group", "mode"), SETTINGS, ids=[f"g{g}-{m}" for g, m in SETTINGS])
def test_layer_parallel_draft_group_is_lossless(ray_driver, tiny_models, tiny_draft_models, group, mode) -> None:
    parallel = DraftParallelConfig(group_size=group, sequential_head=0, sequential_tail=1, mode=mode)
    base = engine_config(tiny_models["llama"], tiny_draft_models["llama"])
    cfg = base.model_copy(update={"speculation": base.speculation.model_copy(update={"draft_parallel": parallel})})
    inst = ray_instance(cfg, TWO_STAGES, num_cpus=CPUS, ready_timeout_s=180)
    try:
        members = inst.draft.executor.actors
        assert len(members) == group  # rank 0 (the draft shard) and group - 1 members
        where = {a: info["Address"]["NodeID"] for a, info in ray_state.actors(actor_state_name="ALIVE").items()}
        node_ids = {n["NodeName"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        stage_nodes = {node_ids[s.node] for s in TWO_STAGES.stages}
        assert all(where[m._actor_id.hex()] in stage_nodes for m in members[1:])  # members sit beside the stages
        prompts = text_prompts(load(tiny_models["llama"]), 4, offset=10)

        completions = generate(inst, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))

        for prompt, c in zip(prompts, completions):
            assert c.error is None
            assert c.token_ids == reference_greedy(tiny_models["llama"], prompt, NEW_TOKENS)
        # the members compute what one process computes: the same drafts, so the same acceptance per request
        local = local_instance(cfg)
        try:
            same = generate(local, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        finally:
            local.shutdown()
        assert [c.stats.accepted for c in completions] == [c.stats.accepted for c in same]
        assert [c.stats.proposed for c in completions] == [c.stats.proposed for c in same]
        assert sum(c.stats.accepted for c in completions) > 0
        stats = inst.stats()
        assert stats.spec.calibration_tokens > 0 and stats.spec.draft_s_per_token > 0
        usage = inst.shard_cache_usage()
        assert [used for used, _ in usage["target"] + usage["draft"]] == [0, 0, 0]
        assert inst.health().healthy
    finally:
        inst.shutdown()


def test_draft_group_runner_drafts_for_an_engine_in_this_process(ray_driver, tiny_models, tiny_draft_models) -> None:
    """The benchmark's shape: the target in this process, the draft group as actors wherever they fit."""
    parallel = DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=0, mode="layer")
    base = engine_config(tiny_models["llama"], tiny_draft_models["llama"])
    cfg = base.model_copy(update={"speculation": base.speculation.model_copy(update={"draft_parallel": parallel})})
    draft, stop = draft_group_runner(cfg, num_cpus=CPUS)
    try:
        assert len(draft.executor.actors) == 2
        engine = Engine(runner(load(tiny_models["llama"]), block_size=CACHE.block_size), draft, cfg.speculation,
                        cfg.scheduler)
        prompts = text_prompts(load(tiny_models["llama"]), 3, offset=10)

        completions = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))

        for prompt, c in zip(prompts, completions):
            assert c.token_ids == reference_greedy(tiny_models["llama"], prompt, NEW_TOKENS)
        assert engine.stats().spec.calibration_tokens > 0
    finally:
        stop()
