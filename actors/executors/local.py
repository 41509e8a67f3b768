"""The in-process stage executor: a model's stages as ModelRunners in this process, activations handed straight on.

It is the executor (actors/executors/protocol.py: the core protocol, ExportsKV and KVLinks) an instance drives when all its
shards sit in the instance's own process (one device, or a test); actors/executors/remote.py is the one for shards in
Ray actors. Both replay the driver's cache ops on every stage before they run, and both turn a stage that fails
or was stopped into a ShardFailure naming it, so the instance (actors/serving/instance.py) treats a failure the same way in either shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.executors.protocol import ShardFailure, StageRun
from actors.kv.cache import KVExport
from actors.kv.ledger import CacheOp, replay
from actors.kv.links import KVPorts, LinkedKV, LinkPart, import_stage, send_stage
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.transport.p2p import free_address
from cluster.migration_messages import Link, Side


class LocalStages:
    """Executor over ModelRunners of one process, in pipeline order; `names` label them in errors. A migration's
    links to or from its stages end in this process (`ports`)."""

    replicated_cache = True  # every stage replays every cache op: block tables agree (prefix caching needs it)

    def __init__(self, runners: Sequence[ModelRunner], names: Sequence[str] | None = None) -> None:
        if not runners:
            raise ValueError("an executor needs at least one stage")
        self.runners: list[ModelRunner | None] = list(runners)
        self.names = list(names) if names is not None else [f"stage {i} (in process)" for i in range(len(runners))]
        if len(self.names) != len(self.runners):
            raise ValueError("one name per stage")
        self.layer_ids = [tuple(r.layer_ids) for r in runners]
        self.calls = 0
        self.ports = KVPorts()

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        """Replay `ops` on every stage, then run `chunks` through them in order: logits (sum num_logits, V)."""
        self.calls += 1
        runners = self._replay(ops, "step")
        if not chunks:
            return StageRun(None)
        x = None
        for name, r in zip(self.names, runners):
            try:
                x = r.forward(chunks, x, parallel)  # hidden (N, H), then logits (sum num_logits, V) from the last
            except Exception as e:  # noqa: BLE001 - any failure of a stage ends the instance, named
                raise ShardFailure(f"step: {name} failed: {type(e).__name__}: {e}") from e
        return StageRun(x)

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        return [r.cache.export(request_id, start, end) for r in self._replay(ops, "KV export")]

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        runners = self._replay(ops, "KV import")
        return all([r.cache.import_(e) for r, e in zip(runners, exports, strict=True)])

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks of each stage's own cache, after replaying `ops`."""
        return [(r.cache.num_used_blocks, r.cache.num_free_blocks) for r in self._replay(ops, "cache usage")]

    # ---- a migration's links: every stage's end is in this process
    def kv_device(self) -> str:
        return self._replay([], "KV device")[0].cache.k.device.type

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        return [free_address(host) for _ in stages]

    def open_links(self, links: list[Link], side: Side, timeout_s: float, backend: str) -> None:
        self.ports.open(links, side, timeout_s, backend)

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        runners = self._replay(ops, "KV export")
        return [part for i, r in enumerate(runners)
                for part in send_stage(r.cache, self.ports, request_id, start, end, [k for k in links if k.src == i])]

    def receive_links(self, kv: LinkedKV) -> None:
        self.ports.receive(kv.parts)

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        runners = self._replay(ops, "KV import")
        return all([import_stage(r.cache, self.ports, kv.request_id, kv.start, [p for p in kv.parts if p.dst == i])
                    for i, r in enumerate(runners)])

    def close_links(self, prefix: str) -> None:
        self.ports.close(prefix)

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the given stages (all by default): their weights and KV are released; calls then fail."""
        for i in range(len(self.runners)) if stages is None else stages:
            self.runners[i] = None

    def _replay(self, ops: list[CacheOp], what: str) -> list[ModelRunner]:
        dead = [name for name, r in zip(self.names, self.runners) if r is None]
        if dead:
            raise ShardFailure(f"{what}: {', '.join(dead)} was stopped")
        runners: list[ModelRunner] = list(self.runners)  # type: ignore[arg-type]  # none is None (checked above)
        for r in runners:
            replay(ops, r.cache)
        return runners
