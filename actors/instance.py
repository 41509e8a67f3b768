"""The instance engine actor: the Engine's step loop over remote shards, and the instance's health.

The Engine (actors/engine.py) runs unchanged over PipelineRunners whose executors are Ray stage groups
(actors/ray_stages.py): one call per target stage per verification, one per draft forward. When a shard
fails (dies, raises, or misses its deadline) the instance turns unhealthy for good: every in-flight request
ends with finish_reason "error" and a message naming the shard, the surviving shards are stopped (they may
be blocked on the dead peer), and later requests are refused. Failover, which would rebuild the shards and
resume the requests elsewhere, comes later.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine import Completion, Engine
from actors.kv_cache import KVExport
from actors.model.loader import load_metadata
from actors.pipeline import PipelineRunner, ShardFailure
from actors.ray_stages import RayStages
from cluster.config import EngineConfig
from cluster.request import FinishReason, Request, SamplingParams, TokenDelta
from cluster.stats import EngineStats


class InstanceUnhealthy(RuntimeError):
    """The instance lost a shard and serves nothing until it is rebuilt."""


@dataclass(frozen=True)
class InstanceHealth:
    """Whether the instance can serve, and if not, why (the first shard failure)."""

    healthy: bool
    error: str | None
    num_stages: int
    has_draft: bool


@dataclass(frozen=True)
class StageGroup:
    """Shard actors of one model in pipeline order, their names for messages, and each one's layers."""

    actors: tuple[ActorHandle, ...]
    names: tuple[str, ...]
    layer_ids: tuple[tuple[int, ...], ...]


class Instance:
    """One model replica over remote shards: the engine, the pipelines it drives, and its health."""

    def __init__(self, cfg: EngineConfig, target: StageGroup, draft: StageGroup | None, step_timeout_s: float) -> None:
        m = cfg.model
        target_model = load_metadata(m.target, m.dtype)
        self.target = PipelineRunner(target_model, cfg.cache, _stages(target, step_timeout_s))
        self.draft = None
        if draft is not None:
            draft_model = load_metadata(m.draft, m.dtype) if m.draft is not None else target_model
            self.draft = PipelineRunner(draft_model, cfg.cache, _stages(draft, step_timeout_s))
        self.engine = Engine(self.target, self.draft, cfg.speculation, cfg.scheduler, m.max_model_len)
        self._error: str | None = None
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; RequestError if it can never be served, InstanceUnhealthy after a shard failure."""
        self._check_healthy()
        self.engine.add_request(request)

    def abort(self, request_id: str) -> TokenDelta | None:
        return self.engine.abort(request_id)

    def step(self) -> list[TokenDelta]:
        """One engine step; after a shard failure, the error deltas of every request in flight (then nothing)."""
        if self._error is not None:
            return []
        try:
            return self.engine.step()
        except ShardFailure as e:
            return self._fail(str(e))

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams) -> list[Completion]:
        """Serve a batch of tokenized prompts to completion, or to the error that ends them; in prompt order."""
        self._check_healthy()
        requests = [Request(f"gen-{next(self._ids)}", tuple(p), params) for p in prompts]
        for r in requests:
            self.engine.check_request(r)
        done: dict[str, Completion] = {}
        for r in requests:
            self.engine.add_request(r)
            seq = next(s for s in self.engine.waiting if s.request_id == r.request_id)
            done[r.request_id] = Completion(r.request_id, list(r.prompt_token_ids), [], "", None, seq.stats)
        while any(c.finish_reason is None for c in done.values()) and self.engine.has_unfinished():
            for delta in self.step():
                c = done.get(delta.request_id)
                if c is not None:
                    c.token_ids.extend(delta.token_ids)
                    c.text += delta.text
                    c.finish_reason, c.error = delta.finish_reason, delta.error
            if self._error is not None:
                break
        for c in done.values():
            if c.finish_reason is None:  # ended by the failure before the engine reported it
                c.finish_reason, c.error = FinishReason.ERROR, f"the instance lost a shard: {self._error}"
        if self._error is None:
            self._flush()
        return list(done.values())

    # ---- health, stats, KV ------------------------------------------------------------------
    def health(self) -> InstanceHealth:
        return InstanceHealth(self._error is None, self._error, len(self.target.executor.layer_ids),
                              self.draft is not None)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shard_cache_usage(self) -> dict[str, list[tuple[int, int]]]:
        """(used, free) blocks of every shard's own cache, after shipping pending ops: each equals its ledger's."""
        self._check_healthy()
        out = {"target": self.target.executor.cache_usage(self.target.cache.drain())}
        if self.draft is not None:
            out["draft"] = self.draft.executor.cache_usage(self.draft.cache.drain())
        return out

    def export_kv(self, request_id: str) -> list[KVExport]:
        """The target KV of a request held by this instance, one export per stage (for migration)."""
        self._check_healthy()
        return self.target.export_kv(request_id)

    def shutdown(self) -> None:
        """Stop the shard actors."""
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.executor.kill()

    # ---- failure ----------------------------------------------------------------------------
    def _check_healthy(self) -> None:
        if self._error is not None:
            raise InstanceUnhealthy(f"the instance is unhealthy: {self._error}")

    def _flush(self) -> None:
        try:
            for runner in (self.target, self.draft):
                if runner is not None:
                    runner.flush()
        except ShardFailure as e:
            self._fail(str(e))

    def _fail(self, message: str) -> list[TokenDelta]:
        """Turn unhealthy, stop the shards, and end every request in flight with an error."""
        self._error = message
        self.shutdown()
        deltas = []
        for seq in list(self.engine.running) + list(self.engine.waiting):
            final = self.engine.abort(seq.request_id)  # frees its KV in the ledgers; nothing reaches the shards
            text = final.text if final is not None else ""
            deltas.append(TokenDelta(seq.request_id, (), text, FinishReason.ERROR,
                                     error=f"the instance lost a shard: {message}"))
        return deltas

    # ---- as a Ray actor ---------------------------------------------------------------------
    @classmethod
    def spawn(cls, cfg: EngineConfig, target: StageGroup, draft: StageGroup | None, *, step_timeout_s: float,
              placement_group: PlacementGroup, bundle_index: int, num_cpus: float) -> ActorHandle:
        """Start the instance engine actor in a bundle of the instance's placement group."""
        strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                    placement_group_bundle_index=bundle_index)
        actor_cls = ray.remote(cls).options(num_cpus=num_cpus, scheduling_strategy=strategy, max_restarts=0)
        return actor_cls.remote(cfg, target, draft, step_timeout_s)


def _stages(group: StageGroup, timeout_s: float) -> RayStages:
    return RayStages(group.actors, group.names, group.layer_ids, timeout_s)
