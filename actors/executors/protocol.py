"""What a stage executor is: a core protocol every executor implements, and the optional ones it may add.

An executor runs a model's stages wherever they are (actors/executors/local.py: this process; actors/executors/remote.py:
stage actors or an EasySpec draft group; actors/executors/experts.py: expert-parallel ranks) for the PipelineRunner that
drives it (actors/executors/pipeline.py). It says what it can do by the protocols it implements, never by flags: whether
its KV moves (ExportsKV), whether its stages carry a migration's KV themselves (KVLinks), whether its ranks are
expert parallel (ExpertRanks). Every call first replays `ops` (the driver's recorded cache ops) on each stage's
cache, and a stage that fails, dies or misses its deadline raises ShardFailure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from actors.kv.cache import KVExport
from actors.kv.ledger import CacheOp
from actors.kv.links import LinkedKV, LinkPart
from actors.model.metadata import SeqChunk
from actors.moe.ep import EPStats
from actors.moe.profile import ExpertRoutingStats
from cluster.migration_messages import Link, Side


class ShardFailure(RuntimeError):
    """A shard died, failed, or did not answer in time: the instance cannot go on."""


@dataclass(frozen=True)
class StageRun:
    """What one `run` gives back: the last stage's logits and the step's figures."""

    logits: torch.Tensor | None  # (sum num_logits, V); None when the call had no chunks
    experts: EPStats | None = None  # the step's expert-parallel figures, every rank's summed (ExpertRanks only)


@runtime_checkable
class StageExecutor(Protocol):
    """The core: run a step, report each stage's cache, stop stages."""

    layer_ids: list[tuple[int, ...]]  # per stage, in pipeline order
    replicated_cache: bool  # whether every stage replays every cache op (prefix caching shares blocks only then)

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        """One forward through every stage (`parallel`: a draft's EasySpec layer groups run in parallel,
        ModelRunner.forward); no chunks: the ops are replayed, nothing runs."""
        ...

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks of each stage's own cache, after replaying `ops`."""
        ...

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the given stages (all by default); any later call raises ShardFailure."""
        ...


@runtime_checkable
class ExportsKV(Protocol):
    """An executor whose KV can be copied out and written in (a migration moves it rather than rebuilding it; a
    layer-parallel draft group's is spread over its members and is rebuilt instead)."""

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        """Each stage's KV of tokens [start, end) of a request, in stage order."""
        ...

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        """Write exports[i] into stage i's cache; False if any stage lacks room."""
        ...


@runtime_checkable
class KVLinks(Protocol):
    """An executor whose stages send and receive a migration's KV themselves, over links (actors/kv/links.py).
    `kv_device`, `link_addresses`, `open_links`, `receive_links` and `close_links` may be called from any thread;
    `send_links` and `import_links` only between steps, like a step."""

    def kv_device(self) -> str:
        """The device type ("cuda" or "cpu") its stages keep their KV on."""
        ...

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        """A rendezvous address on the node of each of `stages` (`host`: this process's node, for its own)."""
        ...

    def open_links(self, links: list[Link], side: Side, timeout_s: float, backend: str) -> None:
        """Each stage joins the links it is an end of (`side.stage(link)`: link.src at SRC, link.dst at DST)."""
        ...

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        """Each stage sends its KV of tokens [start, end) of a request over its links (the sends go on after)."""
        ...

    def receive_links(self, kv: LinkedKV) -> None:
        """Each stage receives the parts sent to it (blocking until they are in)."""
        ...

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        """Each stage writes what it received of `kv` into its cache; False if any lacks room."""
        ...

    def close_links(self, prefix: str) -> None:
        """Forget the links whose ids start with `prefix`, and what arrived on them."""
        ...


@runtime_checkable
class ExpertRanks(Protocol):
    """An executor over expert-parallel ranks (actors/moe/ep.py): its `run` reports the step's figures (StageRun.
    experts), and it tells each rank's figures and the routing of the tokens it ran."""

    def ep_stats(self) -> list[EPStats]:
        """Each rank's expert-parallel figures since the last call."""
        ...

    def routing(self) -> ExpertRoutingStats:
        """The routing statistics of every rank's tokens since the last call (online profiling)."""
        ...
