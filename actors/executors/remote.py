"""The Ray executors of a pipeline and of an EasySpec draft group: one call per actor per step, all in flight at once.

Stage i's call receives its activations from stage i-1 over torch.distributed, so the calls run together
and the step's time is the pipeline's, not the sum of round trips. Both are built on a RankGroup
(actors/executors/rank_group.py), which waits with a deadline and turns a failed, dead or late actor into a ShardFailure
naming it. RayStages moves KV (ExportsKV, KVLinks: each shard is the end of its own links); GroupStages, whose KV
is spread over its members, implements the core protocol only (actors/executors/protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.actor import ActorHandle

from actors.executors.protocol import ShardFailure, StageRun
from actors.kv.cache import KVExport
from actors.kv.ledger import CacheOp
from actors.kv.links import LinkedKV, LinkPart
from actors.model.metadata import SeqChunk
from actors.executors.rank_group import RankGroup
from actors.shards.ray_actors import KV_GROUP
from cluster.migration_messages import Link, Side


class RayStages:
    """Executor over stage actors (actors/shards/ray_actors.py) in pipeline order; the last one returns the logits.
    A migration's KV goes from shard to shard over links (actors/kv/links.py): never through this process."""

    replicated_cache = True  # every stage replays every cache op: block tables agree (prefix caching needs it)

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], layer_ids: Sequence[Sequence[int]],
                 timeout_s: float) -> None:
        if not len(actors) == len(names) == len(layer_ids):
            raise ValueError("one name and one layer list per stage actor")
        self.group = RankGroup(actors, names, timeout_s)
        self.layer_ids = [tuple(ids) for ids in layer_ids]

    @property
    def actors(self) -> list[ActorHandle]:
        return self.group.actors

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        return StageRun(self.group.each(lambda a: a.step.remote(ops, chunks, parallel), "step")[-1])

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        return self.group.each(lambda a: a.export.remote(ops, request_id, start, end), "KV export")

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        if len(exports) != len(self.group):
            raise ValueError(f"{len(exports)} exports for {len(self.group)} stages")
        return all(self.group.some(range(len(self.group)), lambda i, a: a.import_.remote(ops, exports[i]),
                                   "KV import"))

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        return self.group.each(lambda a: a.cache_usage.remote(ops), "cache usage")

    def kill(self, stages: Sequence[int] | None = None) -> None:
        self.group.kill(stages)

    # ---- a migration's links: each shard is the end of its own
    def kv_device(self) -> str:
        devices = self.group.each(lambda a: a.device.options(concurrency_group=KV_GROUP).remote(), "KV device")
        return "cuda" if all(d.startswith("cuda") for d in devices) else "cpu"

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        return self.group.some(stages, lambda _, a: a.rendezvous_address.options(concurrency_group=KV_GROUP).remote(),
                               "KV link address")

    def open_links(self, links: list[Link], side: Side, timeout_s: float, backend: str) -> None:
        ends = _ends(links, side.stage)
        self.group.some(list(ends), lambda i, a: a.kv_open.options(concurrency_group=KV_GROUP).remote(
            ends[i], side, timeout_s, backend), "KV link open", max(self.group.timeout_s, timeout_s + 5))

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        ends = _ends(links, lambda k: k.src)
        sent = self.group.some(range(len(self.group)), lambda i, a: a.kv_send.remote(
            ops, request_id, start, end, ends.get(i, [])), "KV send")
        return [part for parts in sent for part in parts]

    def receive_links(self, kv: LinkedKV) -> None:
        ends = _ends(list(kv.parts), lambda p: p.dst)
        self.group.some(list(ends), lambda i, a: a.kv_receive.options(concurrency_group=KV_GROUP).remote(ends[i]),
                        "KV receive")

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        ends = _ends(list(kv.parts), lambda p: p.dst)
        return all(self.group.some(range(len(self.group)), lambda i, a: a.kv_import.remote(
            ops, kv.request_id, kv.start, ends.get(i, [])), "KV import"))

    def close_links(self, prefix: str) -> None:
        self.group.each(lambda a: a.kv_close.options(concurrency_group=KV_GROUP).remote(prefix), "KV link close")


class GroupStages:
    """An EasySpec draft group (actors/speculation/draft_group.py) as one stage: every member runs each call, rank 0
    (the draft shard) returns the logits; its layers are the whole draft's. Its KV is spread over the group and stays
    there: it exports none, and a migration rebuilds it at the destination (the draft catches up)."""

    replicated_cache = True  # every member replays every cache op

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], layer_ids: Sequence[int],
                 timeout_s: float) -> None:
        self.group = RankGroup(actors, names, timeout_s)
        self.layer_ids = [tuple(layer_ids)]

    @property
    def actors(self) -> list[ActorHandle]:
        return self.group.actors

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        return StageRun(self.group.each(lambda a: a.step.remote(ops, chunks, parallel), "step")[0])

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """Rank 0's (used, free) blocks; every member replays the same ops, so each holds the same block count."""
        usage = self.group.each(lambda a: a.cache_usage.remote(ops), "cache usage")
        if len(set(usage)) > 1:
            raise ShardFailure(f"cache usage: the draft group's members disagree: {usage}")
        return usage[:1]

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the group: its one stage (0) is every member."""
        if stages is None or 0 in stages:
            self.group.kill()


def _ends(items: list, stage_of) -> dict[int, list]:
    """`items` (links or parts) by the stage that is their end here."""
    out: dict[int, list] = {}
    for item in items:
        out.setdefault(stage_of(item), []).append(item)
    return out
