"""Routing profiler and expert permutation (actors/moe/) on the tiny Mixtral and Qwen2-MoE models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.moe.permute import apply_plan, permute_experts
from actors.moe.profile import ExpertRoutingStats, moe_layers, profile
from placement.experts import ExpertPlan
from tests.unit.helpers import runner, text_prompts

MOE_FAMILIES = ("mixtral", "qwen2_moe")


def reference_stats(model, prompts) -> ExpertRoutingStats:
    """The same statistics counted directly from transformers' own router logits (output_router_logits)."""
    cfg = model.config
    layers = list(range(cfg.num_hidden_layers))
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    stats = ExpertRoutingStats.empty(layers, cfg.vocab_size, num_experts, cfg.num_experts_per_tok)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.hf_model(ids, output_router_logits=True)
        chosen = [torch.topk(logits.reshape(len(prompt), -1), cfg.num_experts_per_tok, dim=-1).indices
                  for logits in out.router_logits]  # per layer (N, top_k)
        stats.add(ids[0], chosen)
    return stats


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_profiler_counts_match_transformers_router(tiny_models, family):
    model = load_model(str(tiny_models[family]), "fp32")
    prompts = text_prompts(model, 6)
    got = profile(runner(model), prompts, chunk_tokens=7)  # chunked prefill: counts must not depend on chunks
    want = reference_stats(model, prompts)
    assert got.layers == tuple(moe_layers(runner(model))) == want.layers
    assert got.tokens == sum(map(len, prompts)) == want.tokens
    for name in ("token_expert", "coact", "affinity", "load"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(got.load.sum()) == got.tokens * got.top_k * len(got.layers)


def test_stats_round_trip_and_version_check(tiny_models, tmp_path):
    model = load_model(str(tiny_models["mixtral"]), "fp32")
    stats = profile(runner(model), text_prompts(model, 2))
    stats.save(tmp_path / "routing.safetensors", model="tiny-mixtral")
    back = ExpertRoutingStats.load_file(tmp_path / "routing.safetensors")
    assert back.layers == stats.layers and back.tokens == stats.tokens and torch.equal(back.coact, stats.coact)
    from safetensors.torch import save_file

    save_file({"load": stats.load}, str(tmp_path / "old.safetensors"), metadata={"version": "0"})
    with pytest.raises(ValueError, match="version"):
        ExpertRoutingStats.load_file(tmp_path / "old.safetensors")


def logits_of(r, prompt) -> torch.Tensor:
    out = r.forward([SeqChunk("p", tuple(prompt), len(prompt))])  # (T, V)
    r.cache.free("p")
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_permuting_experts_and_gate_leaves_logits_unchanged(tiny_models, family):
    model = load_model(str(tiny_models[family]), "fp32")  # a private copy: its weights are permuted in place
    r = runner(model)
    prompt = text_prompts(model, 1)[0]
    before = logits_of(r, prompt)
    layers = moe_layers(r)
    rng = np.random.default_rng(0)
    plan = ExpertPlan(num_ranks=2, layers=tuple(layers),
                      ranks=tuple(tuple(int(x) for x in rng.permutation([0, 0, 1, 1])) for _ in layers))
    gate_before = r.layers[0].ffn.router.clone()
    orders = apply_plan(r, plan)
    assert any(o != (0, 1, 2, 3) for o in orders)  # something moved
    assert torch.equal(r.layers[0].ffn.router, gate_before[list(orders[0])])
    torch.testing.assert_close(logits_of(r, prompt), before, rtol=1e-5, atol=1e-5)
    # a permutation of the experts alone (gate left as it was) changes the function: the test can fail
    moe = r.layers[0].ffn
    moe.gate_up.copy_(moe.gate_up[[1, 0, 3, 2]])
    assert not torch.allclose(logits_of(r, prompt), before, rtol=1e-5, atol=1e-5)


def test_permute_rejects_a_non_permutation(tiny_models):
    model = load_model(str(tiny_models["mixtral"]), "fp32")
    with pytest.raises(ValueError, match="permutation"):
        permute_experts(runner(model).layers[0].ffn, [0, 0, 1, 2])
