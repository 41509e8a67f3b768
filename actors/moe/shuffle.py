"""Speculative token shuffling: tensor-parallel attention whose output lands on each token's predicted rank.

Speculative MoE (arXiv 2503.04398, "speculative token shuffling") runs attention tensor parallel
over the expert-parallel ranks (each rank holds a slice of the heads and their KV for every request). The
all-reduce that would follow the attention is split in two: a reduce-scatter that lands each token's attention
output on one rank, and after the MoE an all-gather that gives every rank every token again. Which rank a token
lands on is free, so it is chosen by predicting the token's experts from routing statistics (token id to
expert counts, and the previous MoE layer's experts through the layer-to-layer affinity): a token predicted
well meets its experts at home, and the expert all-to-all carries only what was mispredicted. Gating runs on
the true hidden state, and the reduce-scatter adds the ranks' parts in rank order wherever a token lands, so
the prediction changes what crosses the wire, not the output (to the rounding of expert matmuls over other
batches of rows).

Per decoder layer on rank r of R, with N the step's tokens (every rank holds all N between layers):

    attention   part = o_proj_r(attn over heads_r of norm(x))            (N, H) this rank's share of the sum
    predict     dest = predicted rank of each token (the same on every rank: same inputs, same tables)
    scatter     rank r receives every rank's part of its tokens D_r = {dest == r} and adds them in rank order
    ffn         h = x[D_r] + attention;  y = h + ffn(norm(h))  (MoE: actors/moe/ep.py's dispatch and combine)
    gather      every rank receives every D_s's y (and the experts chosen, for the next layer's prediction)

Without statistics (or below `confidence`) tokens land on a balanced contiguous split: tensor-parallel attention
with plain expert parallelism, the baseline the prediction is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from actors.kv.cache import KVCache
from actors.model.layers import Attention, DecoderLayer, MoE, rms_norm
from actors.model.metadata import AttentionMetadata
from actors.model.runner import ModelRunner
from actors.moe import ep
from actors.moe.profile import ExpertRoutingStats
from placement.experts import ExpertPlan


def head_split(num_heads: int, world_size: int) -> list[tuple[int, int]]:
    """Query heads [lo, hi) of each rank: a balanced contiguous split (ranks may hold one head more).

    >>> head_split(4, 3)
    [(0, 2), (2, 3), (3, 4)]
    """
    if world_size > num_heads:
        raise ValueError(f"tensor-parallel attention over {world_size} ranks needs as many heads ({num_heads})")
    bounds = ep.expert_bounds(num_heads, world_size)  # the experts' balanced contiguous split, over heads
    return list(zip(bounds[:-1], bounds[1:]))


def kv_heads_of(q_lo: int, q_hi: int, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [lo, hi) that query heads [q_lo, q_hi) read (grouped-query attention: nh / kvh per KV head).

    >>> kv_heads_of(2, 3, num_heads=4, num_kv_heads=2)
    (1, 2)
    """
    group = num_heads // num_kv_heads
    return q_lo // group, (q_hi - 1) // group + 1


def _rows(linear: nn.Linear, ranges: list[tuple[int, int]]) -> nn.Linear:
    """Output features in `ranges` [lo, hi) of a projection (its bias too), side by side, as a new module."""
    if not isinstance(linear, nn.Linear):
        raise ValueError("tensor-parallel attention slices dense projections: load with `weights: dequantized`")
    index = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).to(linear.weight.device)
    out = nn.Linear(linear.in_features, len(index), bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight[index], requires_grad=False)  # (n, H), a copy
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[index], requires_grad=False)
    return out


def _columns(linear: nn.Linear, lo: int, hi: int, keep_bias: bool) -> nn.Linear:
    """Input features [lo, hi) of a projection; its bias only where `keep_bias` (one rank adds it)."""
    if not isinstance(linear, nn.Linear):
        raise ValueError("tensor-parallel attention slices dense projections: load with `weights: dequantized`")
    out = nn.Linear(hi - lo, linear.out_features, bias=keep_bias and linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight[:, lo:hi].clone(), requires_grad=False)  # (H, hi - lo)
    if out.bias is not None:
        out.bias = nn.Parameter(linear.bias.clone(), requires_grad=False)
    return out


def slice_attention(attn: Attention, rank: int, world_size: int) -> Attention:
    """Rank `rank`'s heads of a layer's attention: q/k/v rows and o_proj columns of those heads only."""
    q_lo, q_hi = head_split(attn.num_heads, world_size)[rank]
    kv_lo, kv_hi = kv_heads_of(q_lo, q_hi, attn.num_heads, attn.num_kv_heads)
    hd, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    nq, nkv = attn.num_heads * hd, attn.num_kv_heads * hd  # the fused projection's q, k, v row blocks
    qkv = _rows(attn.qkv_proj, [(q_lo * hd, q_hi * hd), (nq + kv_lo * hd, nq + kv_hi * hd),
                                (nq + nkv + kv_lo * hd, nq + nkv + kv_hi * hd)])
    kv_map = torch.tensor([h // group - kv_lo for h in range(q_lo, q_hi)], device=qkv.weight.device)
    return Attention(
        qkv, _columns(attn.o_proj, q_lo * hd, q_hi * hd, rank == 0),
        num_heads=q_hi - q_lo, num_kv_heads=kv_hi - kv_lo, head_dim=hd, sliding_window=attn.sliding_window,
        kv_map=kv_map, qk_norm=attn.qk_norm, qk_norm_fp32=attn.qk_norm_fp32, eps=attn.eps,  # per head: any slice
        q_scale=attn.q_scale,
    )


class TokenPredictor:
    """Each token's predicted rank for each MoE layer, from routing statistics (Speculative MoE's speculation).

    The expert distribution of a token is its token id's profiled distribution in that layer (add-one smoothed),
    times, from the second MoE layer on, the affinity of the experts it chose in the previous MoE layer. The rank
    holding most of that distribution is the prediction; its share of the mass is the confidence. Tables are in
    the rank's loaded expert indices (after the plan's permutation, actors/moe/permute.py).
    """

    def __init__(self, stats: ExpertRoutingStats, plan: ExpertPlan, device: torch.device) -> None:
        if tuple(plan.layers) != tuple(stats.layers):
            raise ValueError(f"the expert plan covers MoE layers {plan.layers}, the statistics {stats.layers}")
        self.layers = {index: pos for pos, index in enumerate(stats.layers)}
        orders = [torch.tensor(plan.order(pos)) for pos in range(len(stats.layers))]  # new index -> own id
        tok = stats.token_expert.double() + 1.0  # (L, V, E)
        self.token = torch.stack([(t / t.sum(-1, keepdim=True))[:, o] for t, o in zip(tok, orders)]).float().to(
            device)  # (L, V, E) in new indices
        aff = stats.affinity.double() + 1.0  # (L-1, E, E)
        self.affinity = torch.stack([(a / a.sum(-1, keepdim=True))[o_prev][:, o]
                                     for a, o_prev, o in zip(aff, orders, orders[1:])]).float().to(device) \
            if len(orders) > 1 else None  # (L-1, E, E): row e (previous layer) -> next layer's experts
        held = torch.tensor([r for r in range(plan.num_ranks) for _ in plan.experts_of(0, r)])  # new index -> rank
        self.onehot = torch.nn.functional.one_hot(held, plan.num_ranks).float().to(device)  # (E, R)

    def predict(self, layer: int, token_ids: torch.Tensor, previous: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids (N,), previous (N, k) experts chosen in the previous MoE layer or None -> rank (N,),
        confidence (N,) for model layer `layer`."""
        pos = self.layers[layer]
        p = self.token[pos][token_ids]  # (N, E)
        if previous is not None and pos > 0 and self.affinity is not None:
            p = p * self.affinity[pos - 1][previous].mean(1)  # (N, E)
        mass = p @ self.onehot  # (N, R)
        share = mass / mass.sum(-1, keepdim=True)
        conf, rank = share.max(-1)
        return rank, conf


def balanced(n: int, world_size: int, device: torch.device) -> torch.Tensor:
    """A contiguous split of n tokens over the ranks: token i -> rank i * R // n. (N,)"""
    return torch.arange(n, device=device) * world_size // max(n, 1)


@dataclass
class Shuffle:
    """What a rank's layers share within a forward: the comm, the predictor, the last MoE layer's experts."""

    comm: ep.ExpertComm
    predictor: TokenPredictor | None
    confidence: float
    stats: ep.EPStats
    previous: torch.Tensor | None = None  # (N, k) every token's experts in the last MoE layer run

    def dest(self, layer: DecoderLayer, token_ids: torch.Tensor) -> torch.Tensor:
        """The rank each token's FFN runs on in `layer`. (N,)"""
        n, world = token_ids.shape[0], self.comm.world_size
        fallback = balanced(n, world, token_ids.device)
        if self.predictor is None or not isinstance(layer.ffn, ep.ExpertParallelMoE):
            return fallback
        rank, conf = self.predictor.predict(layer.index, token_ids, self.previous)
        return torch.where(conf >= self.confidence, rank, fallback)


@dataclass
class ShuffledLayer(DecoderLayer):
    """A decoder layer with tensor-parallel attention and its FFN on each token's predicted rank (see the module)."""

    shuffle: Shuffle | None = None
    first: bool = False  # the runner's first layer: a new forward, no previous experts

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 cache: KVCache) -> torch.Tensor:
        s = self.shuffle
        assert s is not None
        comm, world, rank = s.comm, s.comm.world_size, s.comm.rank
        if self.first:
            s.previous = None
        part = self.attn(rms_norm(x, self.input_norm, self.eps), cos, sin, meta, cache, self.index)  # (N, H)
        dest = s.dest(self, meta.token_ids)  # (N,)
        counts = torch.bincount(dest, minlength=world).tolist()  # tokens landing on each rank (known to all)
        got = comm.exchange([part[dest == r] for r in range(world)], [counts[rank]] * world)  # got[s] (n_r, H)
        attn = got[0]
        for g in got[1:]:
            attn = attn + g  # in rank order, wherever the token landed: the same sum on any rank
        h = x[dest == rank] + attn  # (n_r, H)
        y = h + self.ffn(rms_norm(h, self.post_norm, self.eps))  # (n_r, H)
        moe = isinstance(self.ffn, ep.ExpertParallelMoE)
        rows = torch.cat([y, self.ffn.last_ids.to(y.dtype)], -1) if moe else y  # expert ids ride along (exact)
        back = comm.exchange([rows] * world, counts)  # back[s]: rank s's tokens
        full = rows.new_empty(x.shape[0], rows.shape[1])
        for src, b in enumerate(back):
            full[dest == src] = b
        self._count(part, rows, dest, rank)
        if moe:
            s.previous = full[:, x.shape[1]:].long()  # (N, k)
            self.ffn.last_ids = s.previous  # every token's experts: what the routing recorder counts
        return full[:, :x.shape[1]]

    def _count(self, part: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor, rank: int) -> None:
        s = self.shuffle
        assert s is not None
        sent = int((dest != rank).sum())
        s.stats.attn_bytes += sent * part.shape[1] * part.element_size()  # reduce-scatter
        s.stats.attn_bytes += (s.comm.world_size - 1) * rows.numel() * rows.element_size()  # all-gather


def enable(runner: ModelRunner, comm: ep.ExpertComm, predictor: TokenPredictor | None = None,
           confidence: float = 0.0) -> ep.EPStats:
    """Make `runner` rank `comm.rank` of tensor-parallel attention and expert-parallel MoE: keep only this rank's
    heads (and their KV cache) and experts, and land tokens by `predictor` (None: balanced contiguous split)."""
    moes = [layer.ffn for layer in runner.layers if isinstance(layer.ffn, MoE)]
    num_experts = max((moe.router.shape[0] for moe in moes), default=0)
    if num_experts and float(torch.tensor(num_experts - 1, dtype=runner.model.dtype)) != num_experts - 1:
        raise ValueError(f"{num_experts} experts: their ids do not ride exactly in {runner.model.dtype} rows")
    stats = ep.enable(runner, comm)
    shuffle = Shuffle(comm, predictor, confidence, stats)
    hf_layers = runner.model.hf_model.model.layers
    for pos, layer in enumerate(runner.layers):
        attn = slice_attention(layer.attn, comm.rank, comm.world_size)
        hf = hf_layers[layer.index].self_attn  # drop every head's weights there: this rank runs its own copies
        hf.q_proj = hf.k_proj = hf.v_proj = hf.o_proj = None
        runner.model.prepared.pop(("layer", layer.index, str(runner.device), runner.weights), None)
        runner.layers[pos] = ShuffledLayer(layer.index, layer.input_norm, layer.post_norm, layer.eps, attn,
                                           layer.ffn, shuffle=shuffle, first=pos == 0)
    old, attn = runner.cache, runner.layers[0].attn
    if old.num_used_blocks:
        raise RuntimeError("tensor-parallel attention is enabled before the cache holds anything")
    runner.cache = KVCache(list(old.layer_ids), old.num_blocks + 1, old.block_size, attn.num_kv_heads,
                           attn.head_dim, old.k.dtype, device=runner.device)  # +1: the pool's scratch block
    return stats


def set_stats(runner: ModelRunner, stats: ep.EPStats) -> None:
    """Point every layer's counters at `stats` (a rank's figures start again)."""
    for layer in runner.layers:
        if isinstance(layer.ffn, ep.ExpertParallelMoE):
            layer.ffn.stats = stats
        if isinstance(layer, ShuffledLayer) and layer.shuffle is not None:
            layer.shuffle.stats = stats


def split_kv(k: torch.Tensor, rank: int, world_size: int, num_heads: int) -> torch.Tensor:
    """The KV heads rank `rank` holds, out of a whole layer stack's KV. k (L, T, kvh, hd) -> (L, T, kvh_r, hd)."""
    lo, hi = kv_heads_of(*head_split(num_heads, world_size)[rank], num_heads, k.shape[2])
    return k[:, :, lo:hi]


def join_kv(parts: Sequence[torch.Tensor], num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Whole KV from each rank's heads (a head held twice is taken from the first). parts[r] (L, T, kvh_r, hd)."""
    world, out = len(parts), []
    taken = 0
    for rank, part in enumerate(parts):
        lo, hi = kv_heads_of(*head_split(num_heads, world)[rank], num_heads, num_kv_heads)
        out.append(part[:, :, taken - lo:])
        taken = hi
    return torch.cat(out, dim=2)
