"""Apply an expert placement to a model's weights: reorder each MoE layer's experts and its gate's outputs to match.

Expert parallelism hands rank r a contiguous slice of expert indices. To place the experts an ExpertPlan
(placement/experts.py) groups together on one rank, expert weights are moved so that new index j holds old
expert order[j], and the router's output rows are permuted the same way: a token then picks the same
experts (under their new indices) with the same weights, so the layer computes the same function; only
which rank holds what changes. The transformers module shares these tensors, so it sees the new order too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.layers import MoE
from actors.model.runner import ModelRunner
from placement.experts import ExpertPlan


@torch.no_grad()
def permute_experts(moe: MoE, order: Sequence[int]) -> None:
    """In place: expert j becomes old expert order[j] (gate_up (E, 2I, H), down (E, H, I), router rows (E, H))."""
    n = moe.router.shape[0]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order {list(order)} is not a permutation of the {n} experts")
    index = torch.tensor(order, dtype=torch.long, device=moe.router.device)
    for t in (moe.router, moe.gate_up, moe.down):
        t.copy_(t.index_select(0, index))


def apply_plan(runner: ModelRunner, plan: ExpertPlan) -> list[tuple[int, ...]]:
    """Reorder every MoE layer of `runner` so that each rank's planned experts are contiguous, in rank order.

    Returns, per MoE layer, the order applied (new index -> old expert id); after this the contiguous split
    of expert indices over `plan.num_ranks` ranks realises the plan.
    """
    by_index = {layer.index: layer for layer in runner.layers}
    missing = [i for i in plan.layers if i not in by_index or not isinstance(by_index[i].ffn, MoE)]
    if missing:
        raise ValueError(f"the plan names layers {missing} that are not MoE layers of this runner")
    orders = []
    for pos, index in enumerate(plan.layers):
        order = plan.order(pos)
        permute_experts(by_index[index].ffn, order)
        orders.append(order)
    return orders
