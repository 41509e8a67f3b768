"""The Ray executors of an expert-parallel target: rank actors that each hold whole requests (data-parallel attention),
or a slice of every request's heads (tensor-parallel attention), both on one ExpertRankGroup.

To the engine this is one stage over every layer (a StageExecutor that is also ExpertRanks, actors/executors/protocol.py,
under a PipelineRunner). Each request gets a home rank when first seen (placement/experts.py place_request:
Speculative MoE's request-level pre-scheduling, or the lightest rank); its cache ops, chunks and KV go to that
rank only. A step calls every rank at once:
ranks with chunks run them, the others join each MoE layer's all-to-all with no tokens (actors/moe/ep.py).
The logits come back per rank and are put back in the chunks' order.

With tensor-parallel attention (`experts.attention: tensor`, actors/moe/shuffle.py) every rank holds its heads'
KV of every request and runs every chunk (ShuffledStages): ops and chunks go to all ranks, rank 0's logits come
back, and a request's KV is joined from (and split into) the ranks' heads when it migrates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import ray
import torch
from ray.actor import ActorHandle

from actors.executors.protocol import StageRun
from actors.kv.cache import KVExport
from actors.kv.ledger import CacheOp, Free
from actors.model.loader import LoadedModel
from actors.model.metadata import SeqChunk
from actors.moe.ep import EPStats
from actors.moe.profile import ExpertRoutingStats
from actors.moe.shuffle import join_kv, split_kv
from actors.executors.rank_group import RankGroup
from cluster.config import ExpertParallelConfig
from placement.experts import ExpertPlan, contiguous_plan, place_request, rank_mass

# (a new request's prompt tokens, or None when only its KV arrives; requests homed on each rank) -> its rank
Placer = Callable[[Sequence[int] | None, list[int]], int]


def lightest(_tokens: Sequence[int] | None, loads: list[int]) -> int:
    """The rank with the fewest requests (the lowest on a tie): plain expert parallelism's placement."""
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def placer(cfg: ExpertParallelConfig) -> Placer:
    """The config's request placement: by predicted experts when it names routing statistics, else the lightest."""
    if cfg.stats is None:
        return lightest
    stats = ExpertRoutingStats.load_file(Path(cfg.stats))
    plan = (ExpertPlan.model_validate_json(Path(cfg.plan).read_text()) if cfg.plan is not None
            else contiguous_plan(stats.layers, stats.num_experts, cfg.ranks))
    if plan.num_ranks != cfg.ranks:
        raise ValueError(f"the expert plan {cfg.plan} is for {plan.num_ranks} ranks, the config asks for {cfg.ranks}")
    table = stats.token_expert.numpy()  # (L, V, E), on the host: placement is a control-plane decision

    def place(tokens: Sequence[int] | None, loads: list[int]) -> int:
        return place_request(rank_mass(plan, table, tokens) if tokens else None, loads, cfg.slack)
    return place


class ExpertRankGroup:
    """What both expert-parallel executors are built on: the rank actors (a RankGroup, in rank order), one stage over
    every layer (the ranks split requests or heads, not layers), and each rank's figures since the last `ep_stats`."""

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], num_layers: int,
                 timeout_s: float) -> None:
        self.group = RankGroup(actors, names, timeout_s)
        self.layer_ids = [tuple(range(num_layers))]
        self.since = [EPStats() for _ in self.group.actors]

    @property
    def actors(self) -> list[ActorHandle]:
        return self.group.actors

    def ep_stats(self) -> list[EPStats]:
        """Each rank's expert-parallel figures since the last call."""
        out, self.since = self.since, [EPStats() for _ in self.group.actors]
        return out

    def routing(self) -> ExpertRoutingStats:
        """The routing statistics of every rank's tokens since the last call (online profiling)."""
        parts = self.group.each(lambda a: a.take_routing.remote(), "routing statistics")
        for p in parts[1:]:
            parts[0].merge(p)
        return parts[0]

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop every rank (they are one stage)."""
        self.group.kill()

    def _step(self, call: Callable[[int, ActorHandle], ray.ObjectRef]) -> tuple[list[torch.Tensor | None], EPStats]:
        """`call` (an `ep_step`) on every rank: each rank's logits, and the step's figures (every rank's summed,
        also added to each rank's since the last `ep_stats`)."""
        results: list[tuple[torch.Tensor | None, EPStats]] = self.group.some(range(len(self.group)), call, "step")
        step = EPStats()
        for r, (_, stats) in enumerate(results):
            self.since[r].add(stats)
            step.add(stats)
        return [out for out, _ in results], step


class EPStages(ExpertRankGroup):
    """Executor over expert-parallel ranks holding whole requests (ExpertActor, attention "data"). A request's KV
    lives on its rank alone; a migration moves it through Ray's object store (ExportsKV; no stage-to-stage links)."""

    # each rank replays only its own requests' cache ops, so a block named on one rank means nothing on another:
    # no prefix caching here (a request would need placing where its prefix is; not built)
    replicated_cache = False

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], num_layers: int, timeout_s: float,
                 place: Placer = lightest) -> None:
        super().__init__(actors, names, num_layers, timeout_s)
        self.place = place
        self.home: dict[str, int] = {}  # request -> its rank
        self.pending: list[list[CacheOp]] = [[] for _ in self.actors]  # ops not yet shipped, per rank

    @property
    def loads(self) -> list[int]:
        out = [0] * len(self.actors)
        for r in self.home.values():
            out[r] += 1
        return out

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        for c in chunks:
            self._rank(c.request_id, c.token_ids)
        self._route(ops)
        mine: list[list[SeqChunk]] = [[] for _ in self.actors]
        for c in chunks:
            mine[self.home[c.request_id]].append(c)
        active = bool(chunks)
        logits, figures = self._step(lambda r, a: a.ep_step.remote(self._take(r), mine[r], active))
        if not chunks:
            return StageRun(None, figures)
        rows, taken = [], [0] * len(self.actors)  # put each rank's rows back in the chunks' order
        for c in chunks:
            r = self.home[c.request_id]
            rows.append(logits[r][taken[r]:taken[r] + c.num_logits])
            taken[r] += c.num_logits
        return StageRun(torch.cat(rows), figures)  # (sum num_logits, V)

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        self._route(ops)
        r = self.home[request_id]
        return self.group.some([r], lambda _, a: a.export.remote(self._take(r), request_id, start, end), "KV export")

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        [e] = exports
        self._rank(e.request_id, None)
        self._route(ops)
        r = self.home[e.request_id]
        return self.group.some([r], lambda _, a: a.import_.remote(self._take(r), e), "KV import")[0]

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks over every rank's cache, as one stage."""
        self._route(ops)
        usage = self.group.some(range(len(self.group)), lambda r, a: a.cache_usage.remote(self._take(r)),
                                "cache usage")
        return [(sum(u for u, _ in usage), sum(f for _, f in usage))]

    def _rank(self, request_id: str, tokens: Sequence[int] | None) -> int:
        if request_id not in self.home:
            self.home[request_id] = self.place(tokens, self.loads)
        return self.home[request_id]

    def _route(self, ops: list[CacheOp]) -> None:
        """Queue each op for its request's rank; a freed request forgets its home."""
        for op in ops:
            r = self._rank(op.request_id, None)
            self.pending[r].append(op)
            if isinstance(op, Free):
                del self.home[op.request_id]

    def _take(self, rank: int) -> list[CacheOp]:
        out, self.pending[rank] = self.pending[rank], []
        return out


class ShuffledStages(ExpertRankGroup):
    """Executor over expert-parallel ranks with tensor-parallel attention: each rank holds a slice of the heads of
    every request, so every op and chunk goes to every rank and rank 0's logits come back (actors/moe/shuffle.py);
    a request's KV is joined from the ranks' heads on export and split into them on import (ExportsKV)."""

    replicated_cache = True

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], num_layers: int, timeout_s: float,
                 num_heads: int, num_kv_heads: int) -> None:
        super().__init__(actors, names, num_layers, timeout_s)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        logits, figures = self._step(lambda _, a: a.ep_step.remote(ops, chunks, bool(chunks)))
        return StageRun(logits[0] if chunks else None, figures)

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        parts = self.group.each(lambda a: a.export.remote(ops, request_id, start, end), "KV export")
        return [replace(parts[0], k=join_kv([p.k for p in parts], self.num_heads, self.num_kv_heads),
                        v=join_kv([p.v for p in parts], self.num_heads, self.num_kv_heads))]

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        [e] = exports
        world = len(self.group)
        return all(self.group.some(range(world), lambda r, a: a.import_.remote(
            ops, replace(e, k=split_kv(e.k, r, world, self.num_heads), v=split_kv(e.v, r, world, self.num_heads))),
            "KV import"))

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks: every rank holds every request, so rank 0's cache tells."""
        return self.group.each(lambda a: a.cache_usage.remote(ops), "cache usage")[:1]


def ep_stages(actors: Sequence[ActorHandle], names: Sequence[str], model: LoadedModel, timeout_s: float,
              cfg: ExpertParallelConfig) -> EPStages | ShuffledStages:
    """The executor of `cfg`'s expert-parallel ranks: whole requests per rank, or tensor-parallel attention."""
    if cfg.attention == "tensor":
        c = model.config
        return ShuffledStages(actors, names, model.num_layers, timeout_s, c.num_attention_heads, c.num_key_value_heads)
    return EPStages(actors, names, model.num_layers, timeout_s, placer(cfg))
