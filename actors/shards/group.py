"""An EasySpec draft group's shards: its leader (rank 0, the draft shard proper) and its members (ranks 1..).

The group is one process group (actors/speculation/draft_group.py). The leader holds the whole draft's embedding, head
and the layers it owns, and runs the draft's forward; the layers of a group step owned by other ranks are
computed there, over the group (GroupMembers). A member holds only its own layers and walks the leader's
schedule in lockstep (`follow`), given the same cache ops and chunks each call (actors/executors/remote.py GroupStages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.kv.ledger import CacheOp, replay
from actors.model.metadata import SeqChunk
from actors.transport.p2p import P2P
from actors.shards.stage import Shard, ShardSpec
from actors.speculation import draft_group, easyspec
from cluster.config import DraftParallelConfig


@dataclass(frozen=True)
class MemberSpec:
    """What an EasySpec group member loads and walks: `shard` holds the layers it runs (no embedding, no head, no
    schedule of its own); `draft_layers` are the whole draft's, in order, grouped as `shard`'s draft's config
    says (`groups`)."""

    shard: ShardSpec
    rank: int  # 1.. in the draft group
    draft_layers: tuple[int, ...]
    groups: DraftParallelConfig


class GroupLeader(Shard):
    """Rank 0 of an EasySpec draft group: the draft's forward, its layer groups computed with the members."""

    def __init__(self, spec: ShardSpec, threads: int = 1) -> None:
        super().__init__(spec, threads)
        self.spec = spec

    def _joined(self, p2p: P2P) -> None:
        owner = draft_group.group_owners(self.spec.draft_parallel, self.spec.layer_ids)
        assert self.runner.layer_parallel is not None  # load_shard enabled the draft's groups
        self.runner.layer_parallel.members = draft_group.GroupMembers(owner, p2p)

    @torch.inference_mode()
    def step(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        """Replay `ops`, then run `chunks` through the draft: logits (sum num_logits, V); None without chunks."""
        replay(ops, self.runner.cache)
        if not chunks:
            return None
        return self.runner.forward(chunks, None, parallel).to(self.logits_device)


class GroupMember(Shard):
    """A rank > 0 of an EasySpec draft group: its layers' part of each of the leader's forwards."""

    def __init__(self, spec: MemberSpec, threads: int = 1) -> None:
        super().__init__(spec.shard, threads)
        self.spec = spec
        g = spec.groups
        self.schedule = easyspec.LayerParallel(len(spec.draft_layers), g.group_size, g.sequential_head,
                                               g.sequential_tail, g.mode)
        self.owner = draft_group.group_owners(g, spec.draft_layers)  # draft layer -> the rank that runs it

    @torch.inference_mode()
    def step(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> None:
        """Replay `ops`, then walk the leader's forward over `chunks`, computing this rank's layers."""
        replay(ops, self.runner.cache)
        if chunks:
            draft_group.follow(self.runner, self.schedule, self.spec.draft_layers, self.owner, self._p2p, chunks,
                               parallel)
