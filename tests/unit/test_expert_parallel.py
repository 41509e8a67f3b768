"""Expert parallelism (actors/moe/ep.py) in one process: ranks as threads exchanging through a ThreadGroup.

Each rank loads the model, keeps its slice of the experts and runs its own requests (data-parallel attention);
the logits must equal the whole model's in one runner, with a rank idle or not, with an expert plan or not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.moe import ep
from actors.moe.permute import apply_plan
from actors.moe.profile import moe_layers
from placement.experts import ExpertPlan, contiguous_plan, place_request, rank_mass
from tests.unit.helpers import load, runner, text_prompts

MOE_FAMILIES = ("mixtral", "qwen2_moe")


def ep_forward(path, world: int, batches: list[list[SeqChunk]], plan: ExpertPlan | None = None,
               enable: Callable[[ModelRunner, ep.ExpertComm], ep.EPStats] = ep.enable,
               ) -> tuple[list[torch.Tensor | None], list[ep.EPStats], list]:
    """Run batches[r] on rank r of `world` ranks (threads), each made a rank by `enable`; each rank's logits,
    stats and runner."""
    group = ep.ThreadGroup(world)
    runners, stats = [], []
    for rank in range(world):
        r = runner(load_model(str(path), "fp32"))  # its own copy: enable drops the other ranks' experts
        if plan is not None:
            apply_plan(r, plan)
        stats.append(enable(r, group.comm(rank)))
        runners.append(r)
    out: list[torch.Tensor | None] = [None] * world
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            with torch.inference_mode():
                r = runners[rank]
                if batches[rank]:
                    out[rank] = r.forward(batches[rank])
                else:
                    ep.idle(r, r.model.config.hidden_size, r.model.dtype)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out, stats, runners


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_logits_equal_the_whole_model(tiny_models, family, world) -> None:
    model = load(tiny_models[family])
    prompts = text_prompts(model, 4)
    chunks = [SeqChunk(f"r{i}", tuple(p), 2) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        want = runner(model).forward(chunks)  # (4 * 2, V)
    batches = [[c for i, c in enumerate(chunks) if i % world == r] for r in range(world)]
    got, stats, runners = ep_forward(tiny_models[family], world, batches)
    for r in range(world):
        rows = [2 * i + j for i in range(len(chunks)) if i % world == r for j in range(2)]
        torch.testing.assert_close(got[r], want[rows], rtol=1e-5, atol=1e-5)
    # each rank holds only its share of every MoE layer's experts
    num_experts = runners[0].layers[0].ffn.moe.router.shape[0]
    held = [r.layers[0].ffn.moe.gate_up.shape[0] for r in runners]
    assert sum(held) == num_experts and max(held) - min(held) <= 1
    assert runners[0].model.hf_model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == held[0]
    # every (token, expert) pair was counted once, some served at home and some not
    tokens = sum(len(p) for p in prompts) * len(moe_layers(runner(model)))
    total = ep.EPStats()
    for s in stats:
        total.add(s)
    assert total.tokens == tokens and total.activations == tokens * model.config.num_experts_per_tok
    assert total.served == total.activations and all(s.served > 0 for s in stats)  # each pair ran once, somewhere
    assert 0 < total.local < total.activations and total.bytes_sent > 0


def test_a_rank_without_requests_still_serves_its_experts(tiny_models) -> None:
    model = load(tiny_models["mixtral"])
    prompts = text_prompts(model, 2, offset=3)
    chunks = [SeqChunk(f"r{i}", tuple(p), 1) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        want = runner(model).forward(chunks)
    got, stats, _ = ep_forward(tiny_models["mixtral"], 3, [chunks, [], []])
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert got[1] is None and stats[1].tokens == 0  # rank 1 had no tokens of its own but computed for rank 0
    assert stats[0].local < stats[0].activations  # so rank 0 sent some of its tokens away


def test_an_expert_plan_changes_what_crosses_not_the_logits(tiny_models) -> None:
    model = load(tiny_models["mixtral"])
    chunks = [SeqChunk(f"r{i}", tuple(p), 1) for i, p in enumerate(text_prompts(model, 4, offset=1))]
    with torch.inference_mode():
        want = runner(model).forward(chunks)
    layers = moe_layers(runner(model))
    plan = ExpertPlan(num_ranks=2, layers=tuple(layers), ranks=((1, 0, 0, 1),) * len(layers))
    got, planned, _ = ep_forward(tiny_models["mixtral"], 2, [chunks[:2], chunks[2:]], plan)
    torch.testing.assert_close(torch.cat([got[0], got[1]]), want, rtol=1e-5, atol=1e-5)
    _, contiguous, _ = ep_forward(tiny_models["mixtral"], 2, [chunks[:2], chunks[2:]], None)
    routed = [(s.activations, s.tokens) for s in planned]
    assert routed == [(s.activations, s.tokens) for s in contiguous]  # the same tokens chose the same experts
    # ...but they are served elsewhere: another share of them on their own rank, other bytes on the wire
    assert [(s.local, s.bytes_sent) for s in planned] != [(s.local, s.bytes_sent) for s in contiguous]
    assert [s.served for s in planned] != [s.served for s in contiguous]


def test_a_request_goes_where_its_predicted_experts_are_within_the_slack() -> None:
    plan = contiguous_plan([0, 1], num_experts=4, num_ranks=2)  # rank 0: experts 0, 1; rank 1: 2, 3
    table = np.zeros((2, 5, 4))
    table[:, 1, 3] = 5  # token 1 goes to expert 3 (rank 1)
    table[:, 2, 0] = 2  # token 2 to expert 0 (rank 0)
    mass = rank_mass(plan, table, [1, 1, 2, 4])  # token 4 was never seen: no mass
    assert mass.tolist() == [2.0, 4.0]
    assert place_request(mass, [0, 0], slack=2) == 1
    assert place_request(mass, [0, 3], slack=2) == 0  # rank 1 is too far above the lightest
    assert place_request(None, [2, 1], slack=2) == 1  # no prediction: the lightest
