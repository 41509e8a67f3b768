"""Expert grouping (placement/experts.py) on plain data: balance, local optimality, locality over random placement."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from placement.experts import (
    ExpertPlan,
    best_ranks,
    contiguous_plan,
    group_experts,
    local_activation_rate,
    objective,
)


def planted(rng: np.random.Generator, layers: int, experts: int, groups: int, tokens: int, top_k: int = 2,
            faith: float = 0.9) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic routes with hidden expert groups: a token keeps to one group (with prob `faith` per choice).

    Returns expert_ids (L, N, top_k), coact (L, E, E), affinity (L-1, E, E), load (L, E).
    """
    member = [rng.permutation(experts) % groups for _ in range(layers)]  # per layer: expert -> hidden group
    ids = np.zeros((layers, tokens, top_k), dtype=np.int64)
    for n in range(tokens):
        g = rng.integers(groups)
        for l in range(layers):
            inside = np.flatnonzero(member[l] == g)
            pool = inside if rng.random() < faith else np.arange(experts)
            ids[l, n] = rng.choice(pool, size=top_k, replace=False)
    coact = np.zeros((layers, experts, experts))
    affinity = np.zeros((max(layers - 1, 0), experts, experts))
    load = np.zeros((layers, experts))
    for l in range(layers):
        for row in ids[l]:
            np.add.at(load[l], row, 1)
            for a, b in itertools.permutations(row, 2):
                coact[l, a, b] += 1
        if l + 1 < layers:
            for a_row, b_row in zip(ids[l], ids[l + 1]):
                for a, b in itertools.product(a_row, b_row):
                    affinity[l, a, b] += 1
    return ids, coact, affinity, load


def oracle_rate(plan: ExpertPlan, ids: np.ndarray) -> float:
    """Local activation rate when each token sits, per layer, on the rank holding most of its chosen experts."""
    mass = np.zeros((*ids.shape[:2], plan.num_experts))
    for l, n in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        mass[l, n, ids[l, n]] = 1.0
    return local_activation_rate(plan, ids, best_ranks(plan, mass))


def test_contiguous_plan_splits_experts_in_order():
    plan = contiguous_plan([1, 3], num_experts=6, num_ranks=4)
    assert plan.ranks == ((0, 0, 1, 1, 2, 3),) * 2
    assert plan.experts_of(0, 1) == (2, 3) and plan.order(0) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_grouping_is_balanced_and_no_swap_improves_it(ranks):
    rng = np.random.default_rng(ranks)
    ids, coact, affinity, load = planted(rng, layers=3, experts=8, groups=ranks, tokens=200)
    plan = group_experts([0, 1, 2], coact, affinity, load, num_ranks=ranks, balance=None)  # counts only
    table = np.asarray(plan.ranks)
    for row in table:  # every rank holds its share of every layer (8 experts: sizes differ by at most one)
        counts = np.bincount(row, minlength=ranks)
        assert counts.max() - counts.min() <= 1
    best = objective(table, coact, affinity)
    for l in range(3):  # local optimum: no swap of two experts of one layer raises the objective
        for a, b in itertools.combinations(range(8), 2):
            if table[l, a] != table[l, b]:
                swapped = table.copy()
                swapped[l, a], swapped[l, b] = swapped[l, b], swapped[l, a]
                assert objective(swapped, coact, affinity) <= best + 1e-9


def test_grouping_beats_contiguous_and_random_placement_on_planted_groups():
    rng = np.random.default_rng(7)
    ids, coact, affinity, load = planted(rng, layers=4, experts=16, groups=4, tokens=400)
    grouped = group_experts(range(4), coact, affinity, load, num_ranks=4)
    plain = contiguous_plan(range(4), 16, 4)
    randoms = [ExpertPlan(num_ranks=4, layers=tuple(range(4)),
                          ranks=tuple(tuple(int(r) for r in rng.permutation(np.arange(16) % 4)) for _ in range(4)))
               for _ in range(20)]
    g = oracle_rate(grouped, ids)
    assert g > oracle_rate(plain, ids) + 0.2
    assert g > max(oracle_rate(p, ids) for p in randoms) + 0.2
    # the hidden groups are recovered: locality near the planted faithfulness
    assert g > 0.8


def test_grouping_keeps_each_ranks_expert_load_within_the_balance():
    # experts 0-3 carry most of the load and are chosen together: counts alone would put them on one rank
    coact = np.zeros((1, 8, 8))
    for a, b in itertools.combinations(range(4), 2):
        coact[0, a, b] = coact[0, b, a] = 100.0
    load = np.array([[100.0, 100.0, 100.0, 100.0, 10.0, 10.0, 10.0, 10.0]])
    even = load.sum() / 2

    def peak(plan):
        return np.bincount(np.asarray(plan.ranks[0]), weights=load[0], minlength=2).max() / even

    assert peak(group_experts([0], coact, np.zeros((0, 8, 8)), load, num_ranks=2, balance=None)) > 1.8
    balanced = group_experts([0], coact, np.zeros((0, 8, 8)), load, num_ranks=2, balance=0.25)
    assert peak(balanced) <= 1.25
    assert objective(np.asarray(balanced.ranks), coact, np.zeros((0, 8, 8))) > 0  # still keeps some pairs


def test_local_activation_rate_counts_pairs():
    plan = ExpertPlan(num_ranks=2, layers=(0,), ranks=((0, 0, 1, 1),))
    ids = np.array([[[0, 1], [0, 2], [2, 3]]])  # (L=1, N=3, top_k=2)
    assert local_activation_rate(plan, ids, np.array([[0, 0, 0]])) == pytest.approx(3 / 6)
    assert local_activation_rate(plan, ids, np.array([[0, 1, 1]])) == pytest.approx(5 / 6)


def test_plan_rejects_unbalanced_or_foreign_versions():
    with pytest.raises(ValueError, match="unbalanced"):
        ExpertPlan(num_ranks=2, layers=(0,), ranks=((0, 0, 0, 1),))
    with pytest.raises(ValueError, match="version"):
        ExpertPlan(version=99, num_ranks=2, layers=(0,), ranks=((0, 0, 1, 1),))
