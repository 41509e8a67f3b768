"""A distributed instance on the real local cluster: pipeline stages and the draft as actors on their planned nodes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray
from ray._private import state as ray_state

from actors.serving.build import build_shards, ray_instance
from actors.serving.instance import Instance
from actors.model.loader import load_metadata, load_model_config
from actors.model.metadata import SeqChunk
from actors.engine.offline import generate
from actors.executors.pipeline import PipelineRunner
from actors.executors.remote import RayStages
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams
from placement.layout import ShardLayout, StageSlot
from placement.model_size import model_size_from_config
from placement.planner import plan
from tests.unit.helpers import load, reference_greedy, text_prompts

NEW_TOKENS = 16
CACHE = CacheConfig(block_size=4, num_blocks=256)
CPUS = 0.5  # per actor: the tiny models need little, and several instances share the three 4-CPU nodes
TWO_STAGES = ShardLayout(stages=(StageSlot(node="a100", layers=(0, 2)), StageSlot(node="l4-0", layers=(2, 4))),
                         draft_node="l4-1")


def engine_config(target, draft=None, k: int = 3) -> EngineConfig:
    policy = "fixed" if draft is not None else "off"
    return EngineConfig(model=ModelConfig(target=str(target), draft=str(draft) if draft else None),
                        speculation=SpeculationConfig(policy=policy, k=k), scheduler=SchedulerConfig(max_batch_size=4),
                        cache=CACHE)


def planned_three_stages(ray_cluster, target, draft) -> ShardLayout:
    """The planner's layout for three stages over the cluster's inventory (the draft goes to the fastest node)."""
    sizes = [model_size_from_config(load_model_config(str(p)), dtype_bytes=4) for p in (target, draft)]
    p = plan(ray_cluster.inventory, sizes[0], sizes[1], kv_tokens=CACHE.num_blocks * CACHE.block_size, num_stages=3)
    return ShardLayout.from_plan(p.instances[0])


@pytest.fixture(scope="module", params=["2 stages", "3 stages, planned"])
def instance(request, ray_driver, tiny_models, tiny_draft_models) -> Iterator[tuple[Instance, ShardLayout]]:
    target, draft = tiny_models["llama"], tiny_draft_models["llama"]
    layout = TWO_STAGES if request.param == "2 stages" else planned_three_stages(ray_driver, target, draft)
    inst = ray_instance(engine_config(target, draft), layout, num_cpus=CPUS, ready_timeout_s=180)
    try:
        yield inst, layout
    finally:
        inst.shutdown()


def test_greedy_output_equals_the_targets_own(instance, tiny_models) -> None:
    inst, layout = instance
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=10)

    completions = generate(inst, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))

    for prompt, c in zip(prompts, completions):
        assert c.error is None
        assert c.token_ids == reference_greedy(tiny_models["llama"], prompt, NEW_TOKENS)
    proposed, accepted = sum(c.stats.proposed for c in completions), sum(c.stats.accepted for c in completions)
    assert proposed > accepted > 0  # drafts were accepted, and rejected ones were cropped in every stage
    usage = inst.shard_cache_usage()
    assert [used for used, _ in usage["target"] + usage["draft"]] == [0] * (len(layout.stages) + 1)
    assert inst.health().healthy


def test_each_actor_runs_on_its_planned_node_and_holds_only_its_layers(instance, tiny_models, tiny_draft_models) -> None:
    inst, layout = instance
    node_ids = {n["NodeName"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    # The GCS's actor table (what ray.util.state.list_actors serves through the dashboard, which the local
    # cluster does not start): the node each actor was placed on
    where = {a: info["Address"]["NodeID"] for a, info in ray_state.actors(actor_state_name="ALIVE").items()}
    planned = [s.node for s in layout.stages] + [layout.draft_node]
    actors = [*inst.target.executor.actors, *inst.draft.executor.actors]
    assert [where[a._actor_id.hex()] for a in actors] == [node_ids[n] for n in planned]
    assert ray.get([a.node_id.remote() for a in actors]) == [node_ids[n] for n in planned]

    full = load(tiny_models["llama"]).hf_model
    layer = [sum(p.numel() for p in full.model.layers[i].parameters()) for i in range(4)]
    embed, norm, head = (full.model.embed_tokens.weight.numel(), full.model.norm.weight.numel(),
                         full.lm_head.weight.numel())
    last = len(layout.stages) - 1
    expected = [sum(layer[slice(*s.layers)]) + (embed if i == 0 else 0) + (norm + head if i == last else 0)
                for i, s in enumerate(layout.stages)]
    expected.append(sum(p.numel() for p in load(tiny_draft_models["llama"]).hf_model.parameters()))
    assert ray.get([a.num_parameters.remote() for a in actors]) == expected
    assert sum(expected[:-1]) == sum(p.numel() for p in full.parameters())
    assert ray.get(actors[0].backend.remote()) == "gloo"


def test_kv_exported_from_two_stages_continues_identically_in_three(ray_driver, tiny_models) -> None:
    path = tiny_models["llama"]
    cfg = engine_config(path)
    three = ShardLayout(stages=(StageSlot(node="l4-1", layers=(0, 1)), StageSlot(node="a100", layers=(1, 3)),
                                StageSlot(node="l4-0", layers=(3, 4))))
    shards = [build_shards(cfg, layout, num_cpus=CPUS, ready_timeout_s=180) for layout in (TWO_STAGES, three)]
    try:
        src, dst = (PipelineRunner(load_metadata(str(path)), CACHE,
                                   RayStages(s.target.actors, s.target.names, s.target.layer_ids, timeout_s=60))
                    for s in shards)
        prompt = text_prompts(load(path), 1, offset=3)[0]
        tokens = decode(src, "r", prompt, 4)  # src now holds the prompt and the first 3 tokens

        assert dst.import_kv(src.export_kv("r"))

        assert dst.cache.length("r") == len(prompt) + 3
        rest = decode(dst, "r", tokens[-1:], 8)
        assert decode(src, "r", tokens[-1:], 8) == rest
        reference = reference_greedy(path, prompt, 12)  # ends early at EOS, where decode goes on
        assert (tokens + rest)[:len(reference)] == reference
    finally:
        for s in shards:
            s.kill()


def decode(runner: PipelineRunner, rid: str, feed: list[int], steps: int) -> list[int]:
    """Feed `feed`, then `steps` greedy tokens, each fed back but the last (no stop at EOS)."""
    out: list[int] = []
    for _ in range(steps):
        logits = runner.forward([SeqChunk(rid, tuple(feed))])  # (1, V)
        out.append(int(logits[-1].argmax()))
        feed = out[-1:]
    return out


def test_bench_pipeline_cli_runs_one_and_two_stages_with_identical_output(ray_cluster, tiny_models,
                                                                          tiny_draft_models, tmp_path) -> None:
    import json
    import subprocess
    import sys

    from deploy.infra.local_cluster import RAY_ENV

    out = tmp_path / "pipeline.json"
    env = {**__import__("os").environ, **RAY_ENV}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "bench", "pipeline", "--target", str(tiny_models["llama"]),
         "--draft", str(tiny_draft_models["llama"]), "--stages", "1,2", "--num-prompts", "2", "--max-tokens", "6",
         "--k", "2", "--num-cpus", "0.5", "--state", str(ray_cluster.state_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    one, two = report["runs"]
    assert (one["stages"], two["stages"]) == (1, 2)
    assert one["tokens"] == two["tokens"] > 0 and two["identical_to_first"]
    [boundary] = two["boundaries"]  # stage 0 -> stage 1: one transfer per target forward, each timed
    assert boundary["transfers"] > 0 and boundary["transfer_ms_median"] > 0
