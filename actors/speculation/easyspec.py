"""EasySpec layer-parallel drafting (Wu et al., arXiv 2502.02493): a draft forward whose middle layers run in groups.

The draft's best parallel size is smaller than the target's, so while it drafts most of an instance's devices
idle. EasySpec breaks the draft's sequential layer order: the first and last few layers run in order, the
middle ones in groups whose members each run their layer on the *same* group input, possibly on different
devices. `mode="attention"` (the paper's best variant): every member runs its attention on the group input, the
outputs are gathered, then the members' MLPs run in order on the accumulated residual:

    h = x;  for layer i of the group:  h = h + attn_i(norm_i(x));  h = h + mlp_i(norm'_i(h))

`mode="layer"`: each member runs its whole layer on x and the residual updates are summed. Each member writes
KV only for its own layer. The result approximates the sequential forward, so the KV a parallel forward writes
is "fuzzy"; bonus calibration (actors/speculation/drafters.py) crops it after each verification and re-runs the
accepted tokens in true order. A forward with `parallel=False` runs every layer in order and is exact; a group
of one is the sequential layer, so `group_size=1` is plain drafting.

Where the members' layers run is a `Members`: `LocalMembers` computes them all in this process (tests, one
device); actors/speculation/draft_group.py gathers them from member processes over torch.distributed.
Shape legend as in actors/model/layers.py: N new tokens (packed), H hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from actors.kv.cache import KVCache
from actors.model.layers import DecoderLayer
from actors.model.metadata import AttentionMetadata
from cluster.config import DraftParallelConfig

Mode = Literal["attention", "layer"]


def layer_groups(num_layers: int, group_size: int, head: int, tail: int) -> list[tuple[int, ...]]:
    """Positions 0..num_layers-1 of a draft's layers cut into steps: singletons for the first `head` and last `tail`
    layers, groups of `group_size` (the last may be smaller) between them."""
    if group_size < 1 or head < 0 or tail < 0:
        raise ValueError("group_size must be at least 1, head and tail at least 0")
    middle_end = max(head, num_layers - tail)
    out: list[tuple[int, ...]] = [(i,) for i in range(min(head, num_layers))]
    out += [tuple(range(i, min(i + group_size, middle_end))) for i in range(head, middle_end, group_size)]
    out += [(i,) for i in range(middle_end, num_layers)]
    return out


class Members(Protocol):
    """Runs one step's layers on one input and returns each layer's contribution to the residual stream."""

    def contributions(self, layers: Sequence[DecoderLayer], x: torch.Tensor, what: Mode, cos: torch.Tensor,
                      sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> list[torch.Tensor]:
        """For each layer, on input x (N, H): its attention output (what="attention") or its residual update
        layer(x) - x (what="layer"), each (N, H); every layer writes its KV for the new tokens."""
        ...


def contribution(layer: DecoderLayer, x: torch.Tensor, what: Mode, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """One layer's contribution on input x (N, H): what its attention half adds to the residual stream, or its
    whole-layer residual update. Each layer splits itself into its halves (its own norms around each)."""
    if what == "attention":
        return layer.attention_update(x, cos, sin, meta, cache)
    return layer(x, cos, sin, meta, cache) - x


def ffn_update(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """What a layer's feed-forward half adds to the residual stream h (N, H) -> (N, H)."""
    return layer.ffn_update(h)


class LocalMembers:
    """Every member's layer computed in this process, one after another (the same maths as spread members)."""

    def contributions(self, layers: Sequence[DecoderLayer], x: torch.Tensor, what: Mode, cos: torch.Tensor,
                      sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> list[torch.Tensor]:
        return [contribution(layer, x, what, cos, sin, meta, cache) for layer in layers]


def enable(runner, cfg: DraftParallelConfig, members: Members | None = None) -> None:
    """Give a draft runner (actors/model/runner.py) the layer-parallel schedule `cfg` asks for; nothing if group_size 1."""
    if cfg.enabled:
        for layer in runner.layers:  # a generic-path layer must split into its halves (actors/model/generic.py)
            if not isinstance(layer, DecoderLayer):
                layer.halves()
        runner.layer_parallel = LayerParallel(len(runner.layers), cfg.group_size, cfg.sequential_head,
                                              cfg.sequential_tail, cfg.mode, members)


class LayerParallel:
    """A draft runner's layer-parallel schedule: its steps (positions into the runner's layers), mode and members."""

    def __init__(self, num_layers: int, group_size: int, head: int, tail: int, mode: Mode,
                 members: Members | None = None) -> None:
        self.steps = layer_groups(num_layers, group_size, head, tail)
        self.mode: Mode = mode
        self.members: Members = members or LocalMembers()

    def steps_for(self, parallel: bool) -> list[tuple[int, ...]]:
        """The steps a forward runs: the groups if `parallel`, else every layer alone (true order, exact)."""
        return self.steps if parallel else [(i,) for step in self.steps for i in step]

    def run(self, layers: Sequence[DecoderLayer], x: torch.Tensor, parallel: bool, cos: torch.Tensor,
            sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x (N, H) through every layer, groups in parallel if `parallel`; returns (N, H)."""
        for step in self.steps_for(parallel):
            group = [layers[i] for i in step]
            if self.mode == "layer" and len(group) > 1:
                updates = self.members.contributions(group, x, "layer", cos, sin, meta, cache)
                x = x + torch.stack(updates).sum(0)
                continue
            outs = self.members.contributions(group, x, "attention", cos, sin, meta, cache)
            h = x
            for layer, a in zip(group, outs, strict=True):  # MLPs in order on the accumulated residual
                h = h + a
                h = h + ffn_update(layer, h)
            x = h
        return x
