"""Expert parallelism on the real local cluster: a MoE target's ranks as actors on three nodes, tokens over gloo.

Each rank holds every layer's attention and a slice of the experts; requests are spread over the ranks and
the output must be the target's own greedy output, with speculative decoding on, over 2 and 3 ranks, with
Speculative MoE's expert grouping and request placement off and on, and with tensor-parallel attention and
token-level pre-scheduling.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from actors.serving.build import ray_instance
from actors.serving.server import InstanceServer
from actors.executors.experts import EPStages, ShuffledStages
from actors.executors.protocol import ExpertRanks
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.moe.ep import EPStats
from actors.moe.profile import ExpertRoutingStats, profile
from actors.engine.offline import generate
from cluster.config import CacheConfig, ExpertParallelConfig
from cluster.request import Request, SamplingParams
from placement.experts import group_experts
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot
from tests.ray.test_pipeline_instance import CPUS, NEW_TOKENS, engine_config
from tests.unit.helpers import load, reference_greedy, runner, text_prompts

SLOTS = (StageSlot(node="a100", layers=(0, 1)), StageSlot(node="l4-0", layers=(1, 2)),
         StageSlot(node="l4-1", layers=(2, 4)))


def layout(ranks: int) -> ShardLayout:
    """`ranks` slots on distinct nodes (an EP rank holds every layer: the slots' layer ranges only place them)."""
    slots = SLOTS[:ranks]
    last = slots[-1].model_copy(update={"layers": (slots[-1].layers[0], 4)})
    return ShardLayout(stages=(*slots[:-1], last), draft_node="a100")


@pytest.fixture(scope="module")
def routing(tiny_models, tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """Routing statistics of held-out prompts and an expert plan from them, per rank count: (stats, plan)."""
    out = tmp_path_factory.mktemp("experts")
    model = load_model(str(tiny_models["mixtral"]), "fp32")
    stats = profile(runner(model), text_prompts(model, 12, offset=30))
    stats.save(out / "routing.safetensors")
    plans = {}
    for ranks in (2, 3):
        plan = group_experts(stats.layers, stats.coact.numpy(), stats.affinity.numpy(), stats.load.numpy(), ranks)
        (out / f"plan-{ranks}.json").write_text(plan.model_dump_json())
        plans[ranks] = (out / "routing.safetensors", out / f"plan-{ranks}.json")
    return plans


# plain: contiguous experts, whole requests per rank; grouped: grouped experts and request placement; shuffled:
# grouped experts, tensor-parallel attention and token-level pre-scheduling (actors/moe/shuffle.py). Every layout at 3
# ranks (experts split unevenly), the one that moves the most at 2 (each setting is ~9 s of Ray actors)
SETTINGS = [(2, "shuffled"), (3, "plain"), (3, "grouped"), (3, "shuffled")]


@pytest.mark.parametrize(("ranks", "mode"), SETTINGS, ids=[f"{r}ranks-{m}" for r, m in SETTINGS])
def test_expert_parallel_instance_is_lossless(ray_driver, tiny_models, tiny_draft_models, routing, ranks,
                                              mode) -> None:
    stats_file, plan_file = routing[ranks]
    speculative_moe = mode != "plain"
    experts = ExpertParallelConfig(ranks=ranks, plan=str(plan_file) if speculative_moe else None,
                                   stats=str(stats_file) if speculative_moe else None, slack=1,
                                   attention="tensor" if mode == "shuffled" else "data")
    cfg = engine_config(tiny_models["mixtral"], tiny_draft_models["mixtral"]).model_copy(update={"experts": experts})
    inst = ray_instance(cfg, layout(ranks), num_cpus=CPUS, ready_timeout_s=180)
    try:
        executor = inst.target.executor
        assert isinstance(executor, ExpertRanks) and len(executor.actors) == ranks
        prompts = text_prompts(load(tiny_models["mixtral"]), 5, offset=3)

        completions = generate(inst, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))

        for prompt, c in zip(prompts, completions):
            assert c.error is None
            assert c.token_ids == reference_greedy(tiny_models["mixtral"], prompt, NEW_TOKENS)
        assert sum(c.stats.proposed for c in completions) > 0  # speculative decoding verified through the ranks
        per_rank = executor.ep_stats()
        if mode != "shuffled":  # 5 requests homed before the first step, lightest rank or within a slack of 1:
            assert all(s.tokens > 0 for s in per_rank)  # every rank holds one by construction
        # shuffled: every rank runs every token's attention heads, and a token's FFN lands on its predicted rank,
        # so which ranks run FFN rows depends on the routing tables, not on placement: no per-rank claim
        total = EPStats()
        for s in per_rank:
            total.add(s)
        assert 0 < total.local < total.activations and total.bytes_sent > 0
        engine = inst.engine.stats()  # the same figures, since the start, in the engine's stats (/metrics, status)
        assert engine.moe.local_rate == pytest.approx(total.local_rate)
        assert engine.moe.alltoall_bytes_per_token == pytest.approx(total.bytes_per_token)
        assert total.bytes_per_token > 0
        # every finished request's KV was freed on its rank (only data-parallel ranks give requests a home)
        assert not isinstance(executor, EPStages) or executor.home == {}
    finally:
        inst.shutdown()


def test_tensor_parallel_ranks_share_cached_prefixes_losslessly(ray_driver, tiny_models, tiny_draft_models) -> None:
    """Prefix caching over expert-parallel ranks with tensor-parallel attention: every rank replays every cache op, so
    a block named on the driver is the same block on every rank; prompts that share 40 tokens then differ, one after
    another, give the target's greedy output and find the shared blocks cached (docs/prefix_caching.md)."""
    cfg = engine_config(tiny_models["mixtral"], tiny_draft_models["mixtral"]).model_copy(update={
        "experts": ExpertParallelConfig(ranks=2, attention="tensor"),
        "cache": CacheConfig(block_size=4, num_blocks=256, prefix_caching=True)})
    inst = ray_instance(cfg, layout(2), num_cpus=CPUS, ready_timeout_s=180)
    try:
        assert isinstance(inst.target.executor, ShuffledStages) and inst.engine.prefix_caching
        base, other = text_prompts(load(tiny_models["mixtral"]), 2, offset=0)  # 40 and 9 tokens
        # hits: none at first; the 40 shared tokens; all but the last block of a prompt cached whole (its last token
        # must run)
        for prompt, hits in zip([base + other[:1], base + other[:5], list(base)], (0, 40, 76)):
            c = generate(inst, [prompt], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))[0]
            assert c.error is None and c.token_ids == reference_greedy(tiny_models["mixtral"], prompt, NEW_TOKENS)
            assert inst.engine.stats().prefix_cache.hits == hits
        assert inst.target.cache.num_used_blocks == 0 and inst.target.cache.num_cached_blocks > 0
    finally:
        inst.shutdown()


def test_tensor_parallel_ranks_export_and_import_a_requests_whole_kv(ray_driver, tiny_models) -> None:
    """Ranks that split the heads (3 ranks, 4 heads over 2 KV heads: the last two share one) join a request's KV
    into the whole model's on export and split it back on import (a migration's path)."""
    experts = ExpertParallelConfig(ranks=3, attention="tensor")
    cfg = engine_config(tiny_models["mixtral"]).model_copy(update={"experts": experts})
    inst = ray_instance(cfg, layout(3), num_cpus=CPUS, ready_timeout_s=180)
    try:
        target = inst.target
        assert isinstance(target.executor, ShuffledStages)
        model = load(tiny_models["mixtral"])
        prompt = text_prompts(model, 1, offset=6)[0]
        whole = runner(model)
        with torch.inference_mode():
            want = whole.forward([SeqChunk("p", tuple(prompt), 1)])
        assert target.reserve("p", len(prompt))
        torch.testing.assert_close(target.forward([SeqChunk("p", tuple(prompt), 1)]), want, rtol=1e-5, atol=1e-5)

        [kv] = target.export_kv("p")

        ref = whole.cache.export("p")
        assert kv.k.shape == ref.k.shape  # every KV head, once
        torch.testing.assert_close(kv.k, ref.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v, ref.v, rtol=1e-5, atol=1e-5)
        assert target.import_kv([replace(kv, request_id="q")])
        nxt = int(want[-1].argmax())
        with torch.inference_mode():
            want_next = whole.forward([SeqChunk("p", (nxt,), 1)])
        got_next = target.forward([SeqChunk("q", (nxt,), 1)])  # decodes on the imported KV alone
        torch.testing.assert_close(got_next, want_next, rtol=1e-5, atol=1e-5)
    finally:
        inst.shutdown()


@pytest.mark.parametrize("attention", ["data", "tensor"])
def test_a_served_expert_parallel_instance_counts_its_routing_online(ray_driver, tiny_models, attention) -> None:
    """The instance actor's ranks count the routing of the tokens they run (the served traffic): after greedy
    completions without speculation, the counts equal an offline profile of each prompt plus its output (with
    tensor-parallel attention rank 0 counts every token)."""
    experts = ExpertParallelConfig(ranks=2, attention=attention)
    cfg = engine_config(tiny_models["mixtral"]).model_copy(update={"experts": experts})
    spec = InstanceSpec(instance_id=f"ep-online-{attention}", layout=layout(2), executor="ray", num_cpus=CPUS,
                        engine=cfg)
    handle = InstanceServer.spawn(spec)
    try:
        ray.get(handle.info.remote(), timeout=300)
        model = load(tiny_models["mixtral"])
        prompts = text_prompts(model, 3, offset=8)
        requests = [Request(f"o{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=6))
                    for i, p in enumerate(prompts)]
        outputs = asyncio.run(_generate_all(handle, requests))

        online = _stats_of(ray.get(handle.expert_routing.remote(), timeout=60))

        seen = [list(p) + out[:-1] for p, out in zip(prompts, outputs)]  # the last token is never fed back
        offline = profile(runner(load_model(str(tiny_models["mixtral"]), "fp32")), seen)
        assert online.tokens == offline.tokens == sum(map(len, seen))
        assert torch.equal(online.load, offline.load) and torch.equal(online.token_expert, offline.token_expert)
        assert _stats_of(ray.get(handle.expert_routing.remote(), timeout=60)).tokens == 0  # a read restarts it
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)


async def _generate_all(handle, requests) -> list[list[int]]:
    async def one(request) -> list[int]:
        tokens = []
        async for ref in handle.generate.options(num_returns="streaming").remote(request):
            tokens += (await ref).delta.token_ids
        return tokens
    return await asyncio.gather(*(one(r) for r in requests))


def _stats_of(data: bytes) -> ExpertRoutingStats:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        return ExpertRoutingStats.load_file(Path(f.name))
