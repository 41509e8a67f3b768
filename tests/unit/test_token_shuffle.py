"""Speculative token shuffling (actors/moe/shuffle.py) in one process: ranks as threads of a ThreadGroup.

Every rank holds a slice of the heads and runs every token; each token's FFN runs on its predicted rank. The
logits must equal the whole model's, and the prediction must change what crosses, not the logits.
"""

from __future__ import annotations

import functools

import pytest
import torch

from actors.model.metadata import SeqChunk
from actors.moe import ep, shuffle
from actors.moe.permute import apply_plan
from actors.moe.profile import moe_layers, profile
from placement.experts import contiguous_plan, group_experts
from tests.unit.helpers import load, runner, text_prompts
from tests.unit.test_expert_parallel import MOE_FAMILIES, ep_forward


def chunks_of(model, n: int, offset: int = 0) -> list[SeqChunk]:
    return [SeqChunk(f"r{i}", tuple(p), 2) for i, p in enumerate(text_prompts(model, n, offset))]


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_attention_logits_equal_the_whole_model(tiny_models, family, world) -> None:
    model = load(tiny_models[family])
    chunks = chunks_of(model, 4)
    with torch.inference_mode():
        want = runner(model).forward(chunks)  # (4 * 2, V)
    got, stats, runners = ep_forward(tiny_models[family], world, [chunks] * world, enable=shuffle.enable)
    for r in range(world):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    # each rank holds only its heads (4 heads, 2 KV heads: over 3 ranks 2/1/1, the last two share a KV head)
    heads = [r.layers[0].attn.num_heads for r in runners]
    assert sum(heads) == model.config.num_attention_heads and max(heads) - min(heads) <= 1
    assert runners[0].cache.k.shape[3] == runners[0].layers[0].attn.num_kv_heads < model.config.num_key_value_heads
    # each token's FFN ran on one rank: every (token, expert) pair was counted once over the ranks
    tokens = sum(len(c.token_ids) for c in chunks) * len(moe_layers(runner(model)))
    total = ep.EPStats()
    for s in stats:
        total.add(s)
    assert total.tokens == tokens and total.activations == tokens * model.config.num_experts_per_tok
    assert total.served == total.activations
    assert total.attn_bytes > 0 and 0 < total.local < total.activations


@functools.cache
def routing(path):
    model = load(path)
    return profile(runner(model), [list(c.token_ids) for c in chunks_of(model, 8, offset=4)])


@pytest.mark.parametrize("world", [2, 3])
def test_predicted_ranks_change_what_crosses_not_the_logits(tiny_models, world) -> None:
    path = tiny_models["mixtral"]
    model = load(path)
    chunks = chunks_of(model, 4, offset=4)  # the profiled prompts: the tables know these tokens
    stats = routing(path)
    plan = group_experts(stats.layers, stats.coact.numpy(), stats.affinity.numpy(), stats.load.numpy(), world)

    def tensor_parallel(predict: bool):
        def enable(r, comm):
            apply_plan(r, plan)
            predictor = shuffle.TokenPredictor(stats, plan, r.device) if predict else None
            return shuffle.enable(r, comm, predictor)
        return ep_forward(path, world, [chunks] * world, enable=enable)

    plain, plain_stats, _ = tensor_parallel(False)
    shuffled, shuffled_stats, _ = tensor_parallel(True)
    for r in range(world):
        # the attention's parts are added in the same order wherever a token lands; only the experts' matmuls see
        # other batches of rows (a kernel's rounding may depend on the row count)
        torch.testing.assert_close(plain[r], shuffled[r], rtol=1e-5, atol=1e-5)
    rate = lambda stats: sum(s.local for s in stats) / sum(s.activations for s in stats)  # noqa: E731
    sent = lambda stats: sum(s.bytes_sent for s in stats)  # noqa: E731
    assert rate(shuffled_stats) > rate(plain_stats) and sent(shuffled_stats) < sent(plain_stats)


def test_the_predictor_follows_the_token_table_and_the_previous_layer() -> None:
    from actors.moe.profile import ExpertRoutingStats
    stats = ExpertRoutingStats.empty([0, 1], vocab_size=4, num_experts=4, top_k=1)
    stats.token_expert[0, 1, 3] = 50  # token 1 goes to expert 3 in the first layer: rank 1
    stats.token_expert[0, 2, 0] = 50  # token 2 to expert 0: rank 0
    stats.affinity[0, 3, 1] = 50  # expert 3 leads to expert 1 in the next layer: rank 0
    plan = contiguous_plan([0, 1], num_experts=4, num_ranks=2)  # rank 0: experts 0, 1; rank 1: 2, 3
    p = shuffle.TokenPredictor(stats, plan, torch.device("cpu"))
    rank, conf = p.predict(0, torch.tensor([1, 2, 3]), None)
    assert rank[:2].tolist() == [1, 0] and conf[0] > 0.9 and conf[2] == 0.5  # token 3 never seen: no preference
    rank, _ = p.predict(1, torch.tensor([1]), torch.tensor([[3]]))
    assert rank.tolist() == [0]
    # a plan that swapped experts: the tables follow the loaded (permuted) indices
    swapped = plan.model_copy(update={"ranks": ((1, 1, 0, 0), (0, 0, 1, 1))})
    rank, _ = shuffle.TokenPredictor(stats, swapped, torch.device("cpu")).predict(0, torch.tensor([1]), None)
    assert rank.tolist() == [0]


def test_kv_heads_split_and_join_back() -> None:
    k = torch.randn(2, 5, 2, 3)  # (L, T, kvh, hd): 4 query heads over 2 KV heads
    for world in (1, 2, 3, 4):
        parts = [shuffle.split_kv(k, r, world, num_heads=4) for r in range(world)]
        assert torch.equal(shuffle.join_kv(parts, num_heads=4, num_kv_heads=2), k)
    assert shuffle.head_split(4, 3) == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="needs as many heads"):
        shuffle.head_split(4, 5)
