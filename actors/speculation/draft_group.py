"""EasySpec group members in separate processes: a draft's layer groups computed across shards over torch.distributed.

The draft group is one process group of W ranks (gloo on CPU, NCCL when every member is on a GPU). Rank 0 is
the draft shard proper: it embeds, runs the sequential head and tail layers, the MLPs of attention-mode groups,
and returns the logits. In a group step, member i runs the i-th layer of the group (rank 0 the first), so each
rank owns at most one layer per step and holds KV only for its own layers. A step that involves another rank
is one exchange: rank 0 broadcasts the step's input x (N, H), every rank computes its layer's contribution
(actors/speculation/easyspec.py: attention output, or whole-layer update), and an all-gather hands rank 0 all of
them. A sequential (exact) forward walks the same layers one per step, so a calibration forward costs one
exchange per layer owned by another rank. Followers (ranks > 0) receive the same chunks and cache ops as rank 0
each call and walk the same steps in lockstep (`follow`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from actors.kv.cache import KVCache
from actors.model.layers import DecoderLayer
from actors.model.metadata import AttentionMetadata, SeqChunk
from actors.model.runner import ModelRunner
from actors.transport.p2p import P2P
from actors.speculation.easyspec import LayerParallel, Mode, contribution, layer_groups
from cluster.config import DraftParallelConfig


def owners(steps: Sequence[tuple[int, ...]], layer_ids: Sequence[int]) -> dict[int, int]:
    """Layer index -> the rank that runs it: member i of a group runs its i-th layer; rank 0 every lone layer."""
    return {layer_ids[p]: i for step in steps for i, p in enumerate(step)}


def group_owners(cfg: DraftParallelConfig, layer_ids: Sequence[int]) -> dict[int, int]:
    """`owners` of a draft whose layers are `layer_ids` under `cfg`'s groups."""
    return owners(layer_groups(len(layer_ids), cfg.group_size, cfg.sequential_head, cfg.sequential_tail), layer_ids)


def world_size(cfg: DraftParallelConfig, num_layers: int) -> int:
    """Ranks the draft group needs: its widest group (1 if every layer runs alone)."""
    steps = layer_groups(num_layers, cfg.group_size, cfg.sequential_head, cfg.sequential_tail)
    return max(len(s) for s in steps)


def exchange(p2p: P2P, x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor | None]) -> list[torch.Tensor]:
    """One group step: x (N, H) from rank 0 to every rank, each rank's `compute(x)` (N, H) (zeros where it owns no
    layer of the step) gathered to all; returns the W results in rank order, on this rank's device."""
    wire = x.to(p2p.wire).contiguous()  # (N, H): the GPU under NCCL, host memory under gloo
    dist.broadcast(wire, src=0)
    local = wire.to(p2p.device)
    mine = compute(local)
    mine = torch.zeros_like(local) if mine is None else mine
    out = [torch.empty_like(wire) for _ in range(p2p.world_size)]
    dist.all_gather(out, mine.to(p2p.wire).contiguous())
    return [o.to(p2p.device) for o in out]


class GroupMembers:
    """Members (actors/speculation/easyspec.py) for rank 0: layers owned by other ranks are computed there, over
    `p2p`."""

    def __init__(self, owner: dict[int, int], p2p: P2P) -> None:
        self.owner, self.p2p = owner, p2p

    def contributions(self, layers: Sequence[DecoderLayer], x: torch.Tensor, what: Mode, cos: torch.Tensor,
                      sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> list[torch.Tensor]:
        ranks = [self.owner[layer.index] for layer in layers]
        if all(r == 0 for r in ranks):
            return [contribution(layer, x, what, cos, sin, meta, cache) for layer in layers]
        own: list[torch.Tensor] = []

        def compute(h: torch.Tensor) -> torch.Tensor | None:
            if 0 in ranks:
                own.append(contribution(layers[ranks.index(0)], h, what, cos, sin, meta, cache))
                return own[0]
            return None

        gathered = exchange(self.p2p, x, compute)
        return [own[0] if r == 0 else gathered[r] for r in ranks]


@torch.inference_mode()
def follow(runner: ModelRunner, schedule: LayerParallel, layer_ids: Sequence[int], owner: dict[int, int], p2p: P2P,
           chunks: list[SeqChunk], parallel: bool) -> None:
    """A follower's part of one draft forward: walk rank 0's steps, computing this rank's layers in the exchanges.

    `runner` holds only this rank's layers (and their KV); `layer_ids` are the whole draft's, in order.
    """
    meta, cos, sin = runner.begin(chunks)  # cos, sin (N, 1, hd) each
    n, hidden = meta.num_tokens, runner.model.config.hidden_size
    mine = {layer.index: layer for layer in runner.layers}
    for step in schedule.steps_for(parallel):
        ranks = [owner[layer_ids[p]] for p in step]
        if all(r == 0 for r in ranks):
            continue
        what: Mode = "layer" if schedule.mode == "layer" and len(step) > 1 else "attention"
        layer = mine[layer_ids[step[ranks.index(p2p.rank)]]] if p2p.rank in ranks else None
        x = torch.empty(n, hidden, dtype=runner.model.dtype, device=runner.device)  # (N, H), filled by the broadcast
        exchange(p2p, x, lambda h: contribution(layer, h, what, cos, sin, meta, runner.cache) if layer else None)
    runner.end(chunks)
