"""Expert parallelism: a MoE layer whose experts are split over ranks, tokens reaching them by all-to-all.

Each rank holds the attention weights and a contiguous slice of every MoE layer's experts (after an
ExpertPlan was applied, actors/moe/permute.py, that slice is the plan's group for the rank). Attention is
data parallel: a request's tokens and KV live on one rank, its home. At a MoE layer every rank routes its own
tokens with the full router, then (Speculative MoE's dispatch, arXiv 2503.04398 section 2):

    dispatch  each token goes once to every rank holding one of its top-k experts, with the ids and
              weights of the experts it wants there (the rank's own share never leaves it)
    experts   each rank runs its experts on what it received
    combine   the weighted partial sums go back to the tokens' homes and are added in rank order

Ranks hold experts in ascending index order, so the combine adds a token's expert outputs in the same order
as the one-process layer (actors/model/layers.py MoE.experts). Every rank takes part in every MoE layer of a
step, with zero tokens if it has none (the collectives are global). Gating runs on the true hidden state: a
placement only changes what crosses the wire, never the result.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from actors.model.layers import MoE
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.moe.profile import ExpertRoutingStats
from placement.experts import ExpertPlan, expert_shares


class ExpertComm(Protocol):
    """An all-to-all among the expert-parallel ranks."""

    rank: int
    world_size: int

    def exchange(self, send: list[torch.Tensor], sizes: list[int] | None = None) -> list[torch.Tensor]:
        """send[r] (n_r, *) goes to rank r; returns recv[s] (m_s, *) from each rank s. Rows are what varies;
        `sizes` (each m_s), when the caller knows them, spares exchanging the counts first."""
        ...


class DistComm:
    """ExpertComm over this process's default torch.distributed group (gloo: host memory; NCCL: the GPU)."""

    def __init__(self, wire: torch.device) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.wire = wire  # where tensors must be to cross (actors/transport/p2p.py P2P.wire)

    def exchange(self, send: list[torch.Tensor], sizes: list[int] | None = None) -> list[torch.Tensor]:
        counts = [len(t) for t in send]
        if sizes is None:
            got = torch.empty(len(send), dtype=torch.long, device=self.wire)  # (R,)
            dist.all_to_all_single(got, torch.tensor(counts, dtype=torch.long, device=self.wire))
            sizes = got.tolist()
        rest = send[0].shape[1:]
        out = torch.empty((sum(sizes), *rest), dtype=send[0].dtype, device=self.wire)
        dist.all_to_all_single(out, torch.cat(send).to(self.wire), sizes, counts)
        return list(out.to(send[0].device).split(sizes))


class ThreadGroup:
    """Ranks as threads of one process, exchanging through shared slots: the single-process path of tests."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: list[list[torch.Tensor | None]] = [[None] * world_size for _ in range(world_size)]  # [src][dst]
        self.barrier = threading.Barrier(world_size, timeout=60)

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)


class ThreadComm:
    """One thread's rank in a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def exchange(self, send: list[torch.Tensor], sizes: list[int] | None = None) -> list[torch.Tensor]:
        g = self.group
        g.slots[self.rank] = list(send)
        g.barrier.wait()  # every rank has posted
        out = [g.slots[src][self.rank] for src in range(self.world_size)]
        g.barrier.wait()  # every rank has read: the slots may be reused
        return out  # type: ignore[return-value]


@dataclass
class EPStats:
    """What the expert parallelism of one rank did (Speculative MoE's figures)."""

    tokens: int = 0  # tokens routed, summed over MoE layers
    activations: int = 0  # (token, chosen expert) pairs
    local: int = 0  # of them, served by an expert on the token's home rank
    served: int = 0  # (token, expert) pairs this rank's experts computed, from any rank (its expert load)
    bytes_sent: int = 0  # payload that left this rank: dispatched rows, their routing, combined rows
    # tensor-parallel attention's reduce-scatter and all-gather bytes that left this rank (actors/moe/shuffle.py;
    # they replace the all-reduce such attention needs anyway, so they are not part of the expert all-to-all)
    attn_bytes: int = 0
    seconds: float = 0.0  # in MoE layers, communication included
    per_layer: dict[int, float] = field(default_factory=dict)  # MoE-layer seconds by model layer index
    served_per_layer: dict[int, int] = field(default_factory=dict)  # `served` by model layer index

    def add(self, other: "EPStats") -> None:
        self.tokens += other.tokens
        self.activations += other.activations
        self.local += other.local
        self.served += other.served
        self.bytes_sent += other.bytes_sent
        self.attn_bytes += other.attn_bytes
        self.seconds += other.seconds
        for layer, sec in other.per_layer.items():
            self.per_layer[layer] = self.per_layer.get(layer, 0.0) + sec
        for layer, n in other.served_per_layer.items():
            self.served_per_layer[layer] = self.served_per_layer.get(layer, 0) + n

    @property
    def model_tokens(self) -> float:
        """Tokens through the model: `tokens` counts each once per MoE layer."""
        return self.tokens / len(self.per_layer) if self.per_layer else 0.0

    @property
    def local_rate(self) -> float:
        return self.local / self.activations if self.activations else 0.0

    @property
    def bytes_per_token(self) -> float:
        """All-to-all bytes per token through the model (over every MoE layer)."""
        return self.bytes_sent / self.model_tokens if self.tokens else 0.0

    @property
    def seconds_per_token(self) -> float:
        """MoE-layer seconds per token through the model (over every MoE layer)."""
        return self.seconds / self.model_tokens if self.tokens else 0.0


def expert_bounds(num_experts: int, world_size: int) -> list[int]:
    """First expert index of each rank, then E: the balanced contiguous split of an ExpertPlan."""
    return [0, *itertools.accumulate(expert_shares(num_experts, world_size))]


class ExpertParallelMoE:
    """One rank's part of a MoE layer: the router and shared expert whole, experts [lo, hi) only."""

    def __init__(self, moe: MoE, index: int, comm: ExpertComm, stats: EPStats) -> None:
        num_experts = moe.router.shape[0]
        self.bounds = expert_bounds(num_experts, comm.world_size)
        self.lo, self.hi = self.bounds[comm.rank], self.bounds[comm.rank + 1]
        self.moe, self.index, self.comm, self.stats = moe, index, comm, stats
        self.last_ids: torch.Tensor | None = None  # (N, k) the last call's chosen experts (RoutingRecorder)
        self.starts = torch.tensor(self.bounds[1:-1], device=moe.router.device)  # (R-1,) expert -> rank by bucketize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        moe, k, rank = self.moe, self.moe.top_k, self.comm.rank
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        weights, ids = moe.route(flat)  # (N, k) each
        if moe.weights_in_input_dtype:
            weights = weights.to(flat.dtype)
        self.last_ids = ids
        dest = torch.bucketize(ids, self.starts, right=True)  # (N, k): the rank holding each chosen expert
        rows, xs, metas = [], [], []
        for r in range(self.comm.world_size):
            hit = dest == r  # (N, k)
            tok = hit.any(-1).nonzero().squeeze(-1)  # (n_r,) tokens wanting an expert on rank r
            want = torch.where(hit[tok], ids[tok], -1).to(torch.float32)  # (n_r, k): expert ids there, -1 elsewhere
            rows.append(tok)
            xs.append(flat[tok])
            metas.append(torch.cat([want, weights[tok].to(torch.float32)], dim=-1))  # (n_r, 2k)
        got_x, got_meta = self.comm.exchange(xs), self.comm.exchange(metas)
        partial = [self._experts(gx, gm, weights.dtype) for gx, gm in zip(got_x, got_meta)]  # (m_s, H) per source
        back = self.comm.exchange(partial)  # (n_r, H): my tokens' sums from each rank
        out = torch.zeros_like(flat)
        for tok, y in zip(rows, back):
            out.index_add_(0, tok, y)
        if moe.shared is not None:
            gate = torch.sigmoid(moe.shared_gate(flat)) if moe.shared_gate is not None else 1.0
            out = out + gate * moe.shared(flat)
        self._count(flat, dest, rows, rank, k, time.perf_counter() - started)
        return out.reshape(shape)

    def _experts(self, x: torch.Tensor, meta: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts on tokens sent to it. x (m, H), meta (m, 2k): ids (-1: not here), weights."""
        k = self.moe.top_k
        ids, weights = meta[:, :k].long(), meta[:, k:].to(weight_dtype)  # (m, k) each
        served = int((ids >= 0).sum())
        self.stats.served += served
        self.stats.served_per_layer[self.index] = self.stats.served_per_layer.get(self.index, 0) + served
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            if e < 0:
                continue
            token, slot = torch.where(ids == e)
            j = e - self.lo  # this rank's own index of expert e
            gate, up = F.linear(x[token], self.moe.gate_up[j]).chunk(2, dim=-1)  # (n, I) each
            y = F.linear(self.moe.act(gate) * up, self.moe.down[j])  # (n, H)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _count(self, flat: torch.Tensor, dest: torch.Tensor, rows: list[torch.Tensor], rank: int, k: int,
               seconds: float) -> None:
        s = self.stats
        n = flat.shape[0]
        s.tokens += n
        s.activations += n * k
        s.local += int((dest == rank).sum())
        row_bytes = flat.shape[-1] * flat.element_size()
        remote = sum(len(t) for r, t in enumerate(rows) if r != rank)
        s.bytes_sent += remote * (2 * row_bytes + 2 * k * 4)  # out: rows and routing; back: the same rows, summed
        s.seconds += seconds
        s.per_layer[self.index] = s.per_layer.get(self.index, 0.0) + seconds


def enable(runner: ModelRunner, comm: ExpertComm) -> EPStats:
    """Make every MoE layer of `runner` expert parallel over `comm`: keep only this rank's slice of each layer's
    experts (the rest of the weights are dropped, here and in the transformers module that shared them)."""
    stats = EPStats()
    for layer in runner.layers:
        if not isinstance(layer.ffn, MoE):
            continue
        moe = layer.ffn
        ep = ExpertParallelMoE(moe, layer.index, comm, stats)
        keep = slice(ep.lo, ep.hi)
        moe.gate_up = moe.gate_up[keep].clone()  # (E_r, 2I, H)
        moe.down = moe.down[keep].clone()  # (E_r, H, I)
        experts = runner.model.hf_model.model.layers[layer.index].mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(moe.gate_up, requires_grad=False)
        experts.down_proj = torch.nn.Parameter(moe.down, requires_grad=False)
        layer.ffn = ep
    return stats


class RoutingRecorder:
    """Online routing statistics (actors/moe/profile.py) of the tokens an expert-parallel rank runs, counted in
    the model's own expert ids (a plan applied at load renumbered them: `orders` maps back)."""

    def __init__(self, runner: ModelRunner, plan: ExpertPlan | None = None) -> None:
        self.layers = [layer for layer in runner.layers if isinstance(layer.ffn, ExpertParallelMoE)]
        first = self.layers[0].ffn.moe
        device = first.router.device
        by_index = {index: pos for pos, index in enumerate(plan.layers)} if plan is not None else {}
        self.orders = [torch.tensor(plan.order(by_index[layer.index]), device=device)  # new index -> own id
                       if layer.index in by_index else None for layer in self.layers]
        self.stats = ExpertRoutingStats.empty([layer.index for layer in self.layers], runner.model.config.vocab_size,
                                        first.router.shape[0], first.top_k, device)

    def record(self, chunks: list[SeqChunk]) -> None:
        """Count the forward just run over `chunks` (its tokens packed in chunk order)."""
        device = self.stats.load.device
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)  # (N,)
        ids = []
        for layer, order in zip(self.layers, self.orders):
            got = layer.ffn.last_ids  # (N, k)
            ids.append(order[got] if order is not None else got)
        self.stats.add(token_ids, ids)

    def take(self) -> ExpertRoutingStats:
        """The statistics so far; counting starts again from zero."""
        out = self.stats
        self.stats = ExpertRoutingStats.empty(out.layers, out.token_expert.shape[1], out.num_experts, out.top_k,
                                        out.load.device)
        return out


def idle(runner: ModelRunner, hidden_size: int, dtype: torch.dtype) -> None:
    """Take part in every MoE layer of a step with no tokens of this rank's own (the others have some)."""
    empty = torch.empty(0, hidden_size, dtype=dtype, device=runner.device)
    for layer in runner.layers:
        if isinstance(layer.ffn, ExpertParallelMoE):
            layer.ffn(empty)
