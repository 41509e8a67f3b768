"""One model replica: the Engine's step loop over a stage executor (in this process or Ray actors), and its health.

An instance always drives its target (and draft) through PipelineRunners whose executors run the stages:
LocalStages (actors/executors/local.py) when they live in this process, RayStages (actors/executors/remote.py) when
they are shard actors; the engine (actors/engine/core.py) cannot tell the two apart. When a stage fails (dies,
raises, misses its deadline, or was stopped) the executor raises ShardFailure and the instance turns
unhealthy for good, the same way in both shapes: every request in flight ends with finish_reason "error"
and a message naming the stage, the surviving stages are stopped (remote ones may be blocked on the dead
peer), and later requests are refused. Failover, which would rebuild the shards and resume the requests
elsewhere, comes later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from actors.engine.core import Engine
from actors.engine.migration import EngineMigration
from actors.executors.protocol import ExpertRanks, ShardFailure
from actors.kv.cache import KVExport
from actors.kv.links import MigratedKV
from actors.moe.profile import ExpertRoutingStats
from actors.executors.pipeline import PipelineRunner
from actors.engine.sequence import EngineSequence
from actors.speculation.calibration import CalibrationFile, setup_of
from actors.speculation.structured import CompiledGrammar
from cluster.config import EngineConfig
from cluster.migration_messages import BlockNames, Link, Pipeline, Reservation
from cluster.migration_policy import InstanceLoad
from cluster.prefix_index import CacheEvents, EventLog
from cluster.request import FinishReason, Request, Resume, TokenDelta
from cluster.stats import EngineStats

T = TypeVar("T")


class InstanceUnhealthy(RuntimeError):
    """The instance lost a shard and serves nothing until it is rebuilt."""


@dataclass(frozen=True)
class InstanceHealth:
    """Whether the instance can serve, and if not, why (the first shard failure)."""

    healthy: bool
    error: str | None
    num_stages: int
    has_draft: bool


class Instance:
    """One model replica over a stage executor: the engine, the pipelines it drives, and its health.

    The facade of every engine operation its server uses (requests, the step, reads, a migration's operations):
    each runs on the serving loop's thread, between two steps, and a shard failure under any of them is handled as
    one in a step (`_fail`). `release` frees what the executors' stages hold beyond themselves (a Ray placement
    group); it runs once, at shutdown or after a failure.
    """

    def __init__(self, cfg: EngineConfig, target: PipelineRunner, draft: PipelineRunner | None,
                 release: Callable[[], None] = lambda: None, calibration_dir: Path | None = None,
                 placement: object = None) -> None:
        """`calibration_dir`: where a goodput engine's calibration is kept between starts; with it, one that must
        be timed is timed after the instance takes requests (`idle_work`), off its start. `placement`: where
        stages in other processes run (JSON-able), part of the calibration's key (their forwards' times depend on
        it)."""
        self.target, self.draft = target, draft
        calibration = None
        if calibration_dir is not None and cfg.speculation.policy == "goodput":
            setup = setup_of(cfg, target.device) | ({"placement": placement} if placement is not None else {})
            calibration = CalibrationFile(calibration_dir, setup)
        self.engine = Engine(target, draft, cfg.speculation, cfg.scheduler, cfg.model.max_model_len,
                             prefix_caching=cfg.cache.prefix_caching, prefix_identity=cfg.prefix_identity,
                             deterministic=cfg.deterministic, share_across_tenants=cfg.cache.share_across_tenants,
                             grammar=cfg.grammar, calibration=calibration,
                             calibrate_later=calibration_dir is not None)
        self._moves = EngineMigration(self.engine)
        self._cache_events = EventLog()  # what the router's prefix index learns (cluster/prefix_index.py)
        self._release: Callable[[], None] | None = release
        self._error: str | None = None
        self._undelivered: list[TokenDelta] = []  # error deltas of a failure outside a step: the next step's

    # ---- what the serving loop drives (actors/serving/loop.py) and offline generation (actors/engine/offline.py) ----------
    @property
    def waiting(self) -> list[EngineSequence]:
        return self.engine.waiting

    @property
    def running(self) -> list[EngineSequence]:
        return self.engine.running

    def has_unfinished(self) -> bool:
        return bool(self._undelivered) or self.engine.has_unfinished()

    def check_request(self, request: Request, grammar: CompiledGrammar | None = None) -> CompiledGrammar | None:
        """RequestError if the request can never be served, InstanceUnhealthy after a shard failure; changes nothing."""
        self._check_healthy()
        return self.engine.check_request(request, grammar)

    def add_request(self, request: Request, grammar: CompiledGrammar | None = None) -> EngineSequence:
        """Queue a request; RequestError if it can never be served, InstanceUnhealthy after a shard failure.
        `grammar`: its structured output compiled beforehand (actors/serving/grammar_pool.py), else compiled here."""
        self._check_healthy()
        return self.engine.add_request(request, grammar)

    def abort(self, request_id: str) -> TokenDelta | None:
        return self.engine.abort(request_id)

    def step(self) -> list[TokenDelta]:
        """One engine step; after a shard failure, the error deltas of every request in flight (then nothing)."""
        if self._error is not None:
            deltas, self._undelivered = self._undelivered, []
            return deltas
        try:
            return self.engine.step()
        except ShardFailure as e:
            return self._fail(str(e))

    def idle_work(self) -> bool:
        """What the engine does while no request runs (a calibration left for later: actors/engine/core.py); True while
        more remains. A shard failure under it fails the instance as one in a step would."""
        if self._error is not None:
            return False
        try:
            return self.engine.idle_work()
        except ShardFailure as e:
            self._undelivered += self._fail(str(e))
            return False

    def flush(self) -> None:
        """Ship the cache ops of the last step (frees) to the shards now, rather than with the next step."""
        if self._error is not None:
            return
        try:
            for runner in (self.target, self.draft):
                if runner is not None:
                    runner.flush()
        except ShardFailure as e:
            self._undelivered += self._fail(str(e))

    # ---- what it is, and reads ------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def k(self) -> int:
        """The most drafts a request gets."""
        return self.engine.k

    @property
    def policy(self) -> str:
        """The speculation-length policy's name."""
        return self.engine.policy.name

    def health(self) -> InstanceHealth:
        return InstanceHealth(self._error is None, self._error, len(self.target.executor.layer_ids),
                              self.draft is not None)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def load(self, instance_id: str) -> InstanceLoad:
        """Per-request KV blocks and queued demand (the router's migration policies)."""
        return self.engine.load(instance_id)

    def cache_events(self, snapshot: bool = False) -> CacheEvents:
        """The target's prefix-cache changes since the last call, numbered, or all it holds (`snapshot`)."""
        cache = self.target.cache
        events = cache.take_events()
        return self._cache_events.batch(events.stored, events.removed, events.lost, snapshot, cache.cached_names)

    def kv_blocks_used(self) -> tuple[int, int]:
        """(target, draft) KV blocks in use as the instance accounts them."""
        draft = self.draft.cache.num_used_blocks if self.draft is not None else 0
        return self.target.cache.num_used_blocks, draft

    def expert_routing(self) -> ExpertRoutingStats | None:
        """The routing statistics of the tokens its expert-parallel ranks ran since the last call; None if the
        target is not expert parallel."""
        executor = self.target.executor
        if not isinstance(executor, ExpertRanks):
            return None
        return self._guarded(executor.routing)

    def shard_cache_usage(self) -> dict[Pipeline, list[tuple[int, int]]]:
        """(used, free) blocks of every shard's own cache, after shipping pending ops: each equals its ledger's."""
        self._check_healthy()
        out = {Pipeline.TARGET: self.target.executor.cache_usage(self.target.cache.drain())}
        if self.draft is not None:
            out[Pipeline.DRAFT] = self.draft.executor.cache_usage(self.draft.cache.drain())
        return out

    def export_kv(self, request_id: str) -> list[KVExport]:
        """The target KV of a request held by this instance, one export per stage (for migration)."""
        self._check_healthy()
        return self.target.export_kv(request_id)

    # ---- live migration (actors/engine/migration.py; cluster/migration.py drives it) --------------------
    def kv_length(self, request_id: str) -> int | None:
        """Source: tokens of the request's target KV; None if it is not queued or running here."""
        return self._moves.kv_length(request_id) if self._moves.holds(request_id) else None

    def block_names(self, request_id: str) -> BlockNames:
        return self._moves.block_names(request_id)

    def export(self, pipeline: Pipeline, request_id: str, start: int, end: int, links: list[Link] | None = None
               ) -> tuple[MigratedKV, int] | None:
        return self._guarded(lambda: self._moves.export(pipeline, request_id, start, end, links))

    def stop_out(self, request_id: str, start: int, links: list[Link] | None = None
                 ) -> tuple[EngineSequence, Resume, MigratedKV, int] | None:
        return self._guarded(lambda: self._moves.stop_out(request_id, start, links))

    def release_detached(self, seq: EngineSequence) -> None:
        self._moves.release_detached(seq)

    def reattach(self, seq: EngineSequence) -> None:
        self._moves.reattach(seq)

    def reserve_incoming(self, request_id: str, tokens: int, names: BlockNames = BlockNames()) -> Reservation | None:
        return self._guarded(lambda: self._moves.reserve_incoming(request_id, tokens, names))

    def import_kv(self, pipeline: Pipeline, kv: MigratedKV) -> bool:
        return self._guarded(lambda: self._moves.import_kv(pipeline, kv))

    def drop_incoming(self, request_id: str) -> None:
        self._moves.drop_incoming(request_id)

    def shutdown(self) -> None:
        """Stop every stage and release what they held; idempotent."""
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.executor.kill()
        release, self._release = self._release, None
        if release is not None:
            release()

    # ---- failure ----------------------------------------------------------------------------
    def _check_healthy(self) -> None:
        if self._error is not None:
            raise InstanceUnhealthy(f"the instance is unhealthy: {self._error}")

    def _guarded(self, op: Callable[[], T]) -> T:
        """Run an operation outside a step that reaches the shards: a shard failure under it fails the instance as
        one in a step does (the error deltas go out with the next step), then reaches the caller."""
        try:
            return op()
        except ShardFailure as e:
            if self._error is None:
                self._undelivered += self._fail(str(e))
            raise

    def _fail(self, message: str) -> list[TokenDelta]:
        """Turn unhealthy, stop the shards, and end every request in flight with an error."""
        self._error = message
        self.shutdown()
        deltas = []
        for seq in list(self.engine.running) + list(self.engine.waiting):
            final = self.engine.abort(seq.request_id)  # frees its KV in the ledgers; nothing reaches the shards
            text = final.text if final is not None else ""
            deltas.append(TokenDelta(seq.request_id, (), text, FinishReason.ERROR,
                                     error=f"the instance lost a shard: {message}", instance_failure=True))
        return deltas
