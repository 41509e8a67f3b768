"""Expert placement for expert parallelism: which rank holds each expert of each MoE layer (Speculative MoE).

Speculative MoE (arXiv 2503.04398, "Sem-MoE") observes that a token's experts are predictable from routing
statistics and groups experts that are activated together on the same rank, so that a token placed on the
rank its experts favour finds most of them local and the all-to-all carries less. Two statistics drive the
grouping, both counted over real prompts (actors/moe/profile.py):

- co-activation C[l] (E, E): tokens that chose both experts e and e' in MoE layer l (top-k > 1);
- affinity A[l] (E, E): tokens that chose e in MoE layer l and e' in MoE layer l + 1.

The objective is the co-activation and affinity mass kept on one rank:
    sum_l sum_{e ~ e' in layer l} C[l][e, e'] + sum_l sum_{e in l ~ e' in l+1} A[l][e, e']
where ~ means "on the same rank". `group_experts` maximises it greedily layer by layer (heaviest experts
first, each to the rank it gains most on) under a balanced capacity (every rank holds E / R experts of every
layer, so expert memory is even; with `balance`, also at most (1 + balance) times an even share of each layer's
profiled expert load, so that the most used experts, often chosen together, do not all land on one rank's
compute), then refines by the best improving pairwise swap that keeps those caps until none is left. Fewer
bytes and a busier rank pull against each other (GRACE-MoE, arXiv 2509.25041, makes the same observation):
docs/benchmarks.md measures both.
Pure module: numpy only, tested with plain data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

PLAN_VERSION = 1


class ExpertPlan(BaseModel):
    """Rank of every expert of every MoE layer: `ranks[l][e]` for MoE layer l (in `layers`, model indices)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = PLAN_VERSION
    num_ranks: int
    layers: tuple[int, ...]  # model layer index of each MoE layer, in order
    ranks: tuple[tuple[int, ...], ...]  # (num MoE layers, E)

    @model_validator(mode="after")
    def _balanced(self) -> "ExpertPlan":
        if self.version != PLAN_VERSION:
            raise ValueError(f"expert plan version {self.version}; this build reads version {PLAN_VERSION}")
        if len(self.ranks) != len(self.layers):
            raise ValueError(f"{len(self.ranks)} rank rows for {len(self.layers)} MoE layers")
        sizes = expert_shares(len(self.ranks[0]), self.num_ranks) if self.ranks else []
        for l, row in zip(self.layers, self.ranks):
            counts = np.bincount(np.asarray(row, dtype=np.int64), minlength=self.num_ranks)
            if len(counts) != self.num_ranks or min(row) < 0:
                raise ValueError(f"layer {l}: ranks outside [0, {self.num_ranks})")
            if counts.tolist() != sizes:  # balanced, and each rank's experts fit its contiguous slice
                raise ValueError(f"layer {l}: unbalanced expert counts per rank {counts.tolist()} (expected {sizes})")
        return self

    @property
    def num_experts(self) -> int:
        return len(self.ranks[0])

    def experts_of(self, layer: int, rank: int) -> tuple[int, ...]:
        """Expert ids that MoE layer `layer` (position in `layers`) keeps on `rank`, ascending."""
        return tuple(e for e, r in enumerate(self.ranks[layer]) if r == rank)

    def order(self, layer: int) -> tuple[int, ...]:
        """Experts of a layer sorted by rank (stable): the permutation that makes each rank's experts contiguous."""
        return tuple(sorted(range(self.num_experts), key=lambda e: (self.ranks[layer][e], e)))


def contiguous_plan(layers: Sequence[int], num_experts: int, num_ranks: int) -> ExpertPlan:
    """Plain expert parallelism: rank r holds experts [r E/R, (r+1) E/R) of every layer.

    >>> contiguous_plan([0, 1], num_experts=4, num_ranks=2).ranks
    ((0, 0, 1, 1), (0, 0, 1, 1))
    """
    _check(num_experts, num_ranks)
    row = tuple(r for r, part in enumerate(np.array_split(np.arange(num_experts), num_ranks)) for _ in part)
    return ExpertPlan(num_ranks=num_ranks, layers=tuple(layers), ranks=(row,) * len(layers))


def objective(ranks: np.ndarray, coact: np.ndarray, affinity: np.ndarray) -> float:
    """Co-activation and cross-layer affinity mass kept on one rank. ranks (L, E); coact (L, E, E); affinity (L-1, E, E)."""
    same = ranks[:, :, None] == ranks[:, None, :]  # (L, E, E)
    same &= ~np.eye(ranks.shape[1], dtype=bool)[None]  # an expert is not its own pair
    total = float((coact * same).sum()) / 2  # each unordered pair counted once
    if len(ranks) > 1:
        cross = ranks[:-1, :, None] == ranks[1:, None, :]  # (L-1, E, E): e in l, e' in l+1
        total += float((affinity * cross).sum())
    return total


def group_experts(layers: Sequence[int], coact: np.ndarray, affinity: np.ndarray, load: np.ndarray,
                  num_ranks: int, max_swaps: int = 10_000, balance: float | None = None) -> ExpertPlan:
    """Expert grouping: greedy affinity assignment under balanced capacity, refined by pairwise swaps.

    coact (L, E, E) symmetric, affinity (L-1, E, E), load (L, E) activations per expert. Capacity is E / R experts
    per rank (memory) and, with `balance`, at most (1 + balance) times an even share of each layer's load
    (compute: without it, the most used experts, which are often chosen together, may gather on one rank). A rank
    over its load cap after the greedy pass only takes swaps that lower it. Returns the plan.
    """
    coact, affinity, load = (np.array(a, dtype=np.float64) for a in (coact, affinity, load))
    n_layers, n_experts = load.shape
    _check(n_experts, num_ranks)
    coact[:, np.arange(n_experts), np.arange(n_experts)] = 0.0
    sizes = np.array(expert_shares(n_experts, num_ranks))  # experts per rank
    caps = (load.sum(1) / num_ranks * (1 + balance) if balance is not None
            else np.full(n_layers, np.inf))  # (L,) most load a rank may take
    ranks = np.full((n_layers, n_experts), -1, dtype=np.int64)
    for l in range(n_layers):
        held = np.zeros(num_ranks, dtype=np.int64)
        taken = np.zeros(num_ranks)  # load placed on each rank
        for e in np.argsort(-load[l], kind="stable"):
            gain = np.zeros(num_ranks)
            placed = ranks[l] >= 0
            np.add.at(gain, ranks[l][placed], coact[l, e, placed])
            if l > 0:  # affinity from the previous layer's experts into e
                np.add.at(gain, ranks[l - 1], affinity[l - 1, :, e])
            room = held < sizes
            fits = room & (taken + load[l, e] <= caps[l])
            if fits.any():
                gain[~fits] = -np.inf
                best = np.flatnonzero(gain == gain.max())
                r = int(best[np.argmin(held[best])])  # ties: the emptiest rank
            else:  # over every cap: the least loaded rank with room
                r = int(np.flatnonzero(room)[np.argmin(taken[room])])
            ranks[l, e] = r
            held[r] += 1
            taken[r] += load[l, e]
    _refine(ranks, coact, affinity, load, caps, num_ranks, max_swaps)
    return ExpertPlan(num_ranks=num_ranks, layers=tuple(layers), ranks=tuple(tuple(int(r) for r in row) for row in ranks))


def _refine(ranks: np.ndarray, coact: np.ndarray, affinity: np.ndarray, load: np.ndarray, caps: np.ndarray,
            num_ranks: int, max_swaps: int) -> None:
    """Apply the best improving swap of two experts of one layer on different ranks until none improves; a swap
    may not take a rank over its load cap, nor raise a rank already over it."""
    n_layers, n_experts = ranks.shape
    for _ in range(max_swaps):
        best, best_delta = None, 1e-9
        for l in range(n_layers):
            # w[e, r]: mass linking expert e to rank r (same-layer co-activation + both neighbours' affinity)
            w = np.zeros((n_experts, num_ranks))
            for r in range(num_ranks):
                w[:, r] = coact[l][:, ranks[l] == r].sum(1)
                if l > 0:
                    w[:, r] += affinity[l - 1][ranks[l - 1] == r, :].sum(0)
                if l + 1 < n_layers:
                    w[:, r] += affinity[l][:, ranks[l + 1] == r].sum(1)
            ra = ranks[l]
            # swapping a and b: a gains w[a, ra[b]] - w[a, ra[a]], b likewise; their own pair is split before
            # and after, but each side's w counted it once on the other's rank
            move = w[:, ra] - w[np.arange(n_experts), ra][:, None]  # (E, E): e moved onto the rank of j
            delta = move + move.T - 2 * coact[l]
            delta[ra[:, None] == ra[None, :]] = -np.inf
            rank_load = np.bincount(ra, weights=load[l], minlength=num_ranks)
            before = rank_load[ra]  # (E,): the load of each expert's rank
            after = before[:, None] - load[l][:, None] + load[l][None, :]  # (E, E): a's rank once a and b swap
            ok = (after <= caps[l]) | (after <= before[:, None])  # within the cap, or no worse than before
            delta[~(ok & ok.T)] = -np.inf
            a, b = np.unravel_index(np.argmax(delta), delta.shape)
            if delta[a, b] > best_delta:
                best, best_delta = (l, a, b), delta[a, b]
        if best is None:
            return
        l, a, b = best
        ranks[l, a], ranks[l, b] = ranks[l, b], ranks[l, a]


def local_activation_rate(plan: ExpertPlan, expert_ids: np.ndarray, token_ranks: np.ndarray) -> float:
    """Share of (token, chosen expert) pairs whose expert sits on the token's rank.

    expert_ids (L, N, top_k): each token's chosen experts per MoE layer; token_ranks (L, N): the rank each token
    is on when it enters that layer's MoE.
    """
    table = np.asarray(plan.ranks)  # (L, E)
    ids = np.asarray(expert_ids)
    held = np.take_along_axis(table[:, None, :].repeat(ids.shape[1], 1), ids, axis=2)  # (L, N, top_k)
    return float((held == np.asarray(token_ranks)[:, :, None]).mean())


def best_ranks(plan: ExpertPlan, expert_mass: np.ndarray) -> np.ndarray:
    """The rank holding most of each token's expert mass. expert_mass (L, N, E) -> ranks (L, N)."""
    table = np.asarray(plan.ranks)  # (L, E)
    onehot = table[:, :, None] == np.arange(plan.num_ranks)[None, None, :]  # (L, E, R)
    per_rank = np.einsum("lne,ler->lnr", np.asarray(expert_mass, dtype=np.float64), onehot.astype(np.float64))
    return per_rank.argmax(-1)


def expert_shares(num_experts: int, num_ranks: int) -> list[int]:
    """Experts per rank under a balanced split: the first E mod R ranks hold one more."""
    return [len(p) for p in np.array_split(np.arange(num_experts), num_ranks)]


def _check(num_experts: int, num_ranks: int) -> None:
    if not 1 <= num_ranks <= num_experts:
        raise ValueError(f"{num_ranks} ranks for {num_experts} experts: need 1 <= ranks <= experts")


def rank_mass(plan: ExpertPlan, token_expert: np.ndarray, token_ids: Sequence[int]) -> np.ndarray:
    """Speculative MoE's request-level prediction: how much of a prompt's expected expert use each rank holds.

    token_expert (L, V, E): per MoE layer, how often each token id chose each expert (actors/moe/profile.py).
    Each prompt token contributes its profiled expert distribution per layer (nothing if never seen); the
    result (R,) sums that mass over the experts each rank holds, over layers and tokens.
    """
    rows = np.asarray(token_expert)[:, np.asarray(token_ids, dtype=np.int64), :].astype(np.float64)  # (L, n, E)
    dist = rows / np.maximum(rows.sum(-1, keepdims=True), 1.0)  # per token and layer, sums to 1 (or 0: unseen)
    per_expert = dist.sum(1)  # (L, E)
    table = np.asarray(plan.ranks)  # (L, E)
    return np.array([per_expert[table == r].sum() for r in range(plan.num_ranks)])


def place_request(mass: np.ndarray | None, loads: Sequence[int], slack: int) -> int:
    """The home rank of a new request: among ranks within `slack` requests of the lightest, the one holding
    most of its predicted expert mass (ties and no prediction: the lightest, then the lowest rank)."""
    lightest = min(loads)
    candidates = [r for r, n in enumerate(loads) if n <= lightest + slack]
    if mass is None or not np.asarray(mass).any():
        return min(candidates, key=lambda r: (loads[r], r))
    return max(candidates, key=lambda r: (mass[r], -loads[r], -r))
