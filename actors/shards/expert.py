"""An expert-parallel rank's shard: every layer, a slice of each MoE layer's experts, tokens exchanged by all-to-all.

With data-parallel attention (`attention: data`) the rank runs its own requests whole (actors/moe/ep.py); with
tensor-parallel attention (`attention: tensor`) every rank runs every chunk over its slice of the heads, each
token's FFN on the rank its experts are predicted on (actors/moe/shuffle.py). Its driver is an expert executor
(actors/executors/experts.py), which calls `ep_step` on every rank each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from actors.kv.ledger import CacheOp, replay
from actors.model.metadata import SeqChunk
from actors.moe import ep, shuffle
from actors.moe.profile import ExpertRoutingStats
from actors.transport.p2p import P2P
from actors.shards.stage import Shard, ShardSpec
from placement.experts import ExpertPlan, contiguous_plan


@dataclass(frozen=True)
class ExpertSpec:
    """What an expert-parallel rank loads: `shard` (every layer, first and last), as rank `rank` of `size`, its
    experts reordered by the ExpertPlan JSON `plan` (None: contiguous). "tensor" `attention`: heads split over the
    ranks too, tokens shuffled by the routing statistics `stats` where a prediction's confidence is >=
    `confidence`; "data": whole requests per rank."""

    shard: ShardSpec
    rank: int
    size: int
    plan: str | None = None
    attention: str = "data"
    stats: str | None = None
    confidence: float = 0.0


def load_plan(spec: ExpertSpec) -> ExpertPlan | None:
    """The expert plan an expert-parallel rank loads its experts by (None: contiguous)."""
    return ExpertPlan.model_validate_json(Path(spec.plan).read_text()) if spec.plan is not None else None


class ExpertWorker(Shard):
    """An expert-parallel rank: its step, its figures, and the routing statistics of the tokens it ran."""

    def __init__(self, spec: ExpertSpec, threads: int = 1) -> None:
        plan = load_plan(spec)  # read once: loading and online routing use it
        super().__init__(spec.shard, threads, plan)
        self.spec, self.plan = spec, plan
        self.ep_stats: ep.EPStats | None = None  # its figures, from `join` on
        self.routing: ep.RoutingRecorder | None = None  # and its online routing statistics

    def _joined(self, p2p: P2P) -> None:
        """Its MoE layers exchange tokens over the group from now on."""
        comm = ep.DistComm(p2p.wire)
        if self.spec.attention == "tensor":
            self.ep_stats = shuffle.enable(self.runner, comm, self._predictor(), self.spec.confidence)
        else:
            self.ep_stats = ep.enable(self.runner, comm)
        self.routing = ep.RoutingRecorder(self.runner, self.plan)

    def _predictor(self) -> shuffle.TokenPredictor | None:
        """A tensor-parallel rank's token predictor, from its routing statistics (None without)."""
        spec = self.spec
        if spec.stats is None:
            return None
        stats = ExpertRoutingStats.load_file(Path(spec.stats))
        plan = self.plan or contiguous_plan(stats.layers, stats.num_experts, spec.size)
        return shuffle.TokenPredictor(stats, plan, self.runner.device)

    @torch.inference_mode()
    def ep_step(self, ops: list[CacheOp], chunks: list[SeqChunk], active: bool
                ) -> tuple[torch.Tensor | None, ep.EPStats]:
        """Replay `ops`, run its own requests' `chunks` through the whole model (logits (sum num_logits, V)); with
        none of its own while other ranks run (`active`), take part in every MoE layer's exchange with no tokens.
        Also returns the step's expert-parallel figures.

        Tensor-parallel attention: every rank runs every chunk; rank 0 returns the logits and counts the routing
        (its layers know every token's experts)."""
        replay(ops, self.runner.cache)
        out = None
        if chunks:
            logits = self.runner.forward(chunks)  # (sum num_logits, V)
            if self.spec.attention == "data" or self.spec.rank == 0:  # the others' logits are rank 0's
                out = logits.to(self.logits_device)
                if self.routing is not None:
                    self.routing.record(chunks)
        elif active:
            cfg = self.runner.model.config
            ep.idle(self.runner, cfg.hidden_size, self.runner.model.dtype)
        return out, self.take_ep_stats()

    def take_ep_stats(self) -> ep.EPStats:
        """The expert-parallel figures since the last call (each step's go back with it: ep_step)."""
        if self.ep_stats is None:
            raise RuntimeError("this rank has not joined its group")
        out, self.ep_stats = self.ep_stats, ep.EPStats()
        shuffle.set_stats(self.runner, self.ep_stats)
        return out

    def take_routing(self) -> ExpertRoutingStats:
        """The routing statistics of the tokens this rank ran since the last call (in the model's expert ids)."""
        if self.routing is None:
            raise RuntimeError("this rank has not joined its group")
        return self.routing.take()
