"""The Ray executor of a pipeline: one call per stage per step, all in flight at once, waited on with a deadline.

Stage i's call receives its activations from stage i-1 over torch.distributed, so the calls run together
and the step's time is the pipeline's, not the sum of round trips. Any stage that dies (RayActorError),
raises, or does not answer within `timeout_s` ends the wait at once with a ShardFailure naming it: the
pipeline is then out of step and the instance stops using it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.kv_cache import KVExport
from actors.kv_ledger import CacheOp
from actors.kv_links import LinkedKV, LinkPart
from actors.model.metadata import SeqChunk
from actors.pipeline import ShardFailure
from actors.shard_actor import KV_GROUP
from cluster.migration import Link


class RayStages:
    """StageExecutor over shard actors (actors/shard_actor.py), named for error messages (e.g. "stage 1 on l4-0").
    A migration's KV goes from shard to shard over links (actors/kv_links.py): never through this process."""

    exports_kv = True
    kv_links = True
    replicated_cache = True  # every stage replays every cache op: block tables agree (prefix caching needs it)

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], layer_ids: Sequence[Sequence[int]],
                 timeout_s: float) -> None:
        if not len(actors) == len(names) == len(layer_ids):
            raise ValueError("one name and one layer list per stage actor")
        self.actors, self.names = list(actors), list(names)
        self.layer_ids = [tuple(ids) for ids in layer_ids]
        self.timeout_s = timeout_s

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        return self._gather([a.step.remote(ops, chunks, parallel) for a in self.actors], "step")[-1]

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        return self._gather([a.export.remote(ops, request_id, start, end) for a in self.actors], "KV export")

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        refs = [a.import_.remote(ops, e) for a, e in zip(self.actors, exports, strict=True)]
        return all(self._gather(refs, "KV import"))

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks of each stage's own cache, after replaying `ops`."""
        return self._gather([a.cache_usage.remote(ops) for a in self.actors], "cache usage")

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the given stage actors (all by default; after a failure the survivors may be blocked on a dead peer)."""
        for i in range(len(self.actors)) if stages is None else stages:
            ray.kill(self.actors[i], no_restart=True)

    # ---- a migration's links: each shard is the end of its own
    def kv_device(self) -> str:
        devices = self._gather([a.device.options(concurrency_group=KV_GROUP).remote() for a in self.actors],
                               "KV device")
        return "cuda" if all(d.startswith("cuda") for d in devices) else "cpu"

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        refs = [self.actors[i].rendezvous_address.options(concurrency_group=KV_GROUP).remote() for i in stages]
        return gather(refs, [self.names[i] for i in stages], "KV link address", self.timeout_s)

    def open_links(self, links: list[Link], side: str, timeout_s: float, backend: str) -> None:
        ends = self._ends(links, lambda k: k.src if side == "src" else k.dst)
        refs = [self.actors[i].kv_open.options(concurrency_group=KV_GROUP).remote(mine, side, timeout_s, backend)
                for i, mine in ends.items()]
        gather(refs, [self.names[i] for i in ends], "KV link open", max(self.timeout_s, timeout_s + 5))

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        ends = self._ends(links, lambda k: k.src)
        refs = [a.kv_send.remote(ops, request_id, start, end, ends.get(i, [])) for i, a in enumerate(self.actors)]
        return [part for parts in self._gather(refs, "KV send") for part in parts]

    def receive_links(self, kv: LinkedKV) -> None:
        ends = self._ends(list(kv.parts), lambda p: p.dst)
        refs = [self.actors[i].kv_receive.options(concurrency_group=KV_GROUP).remote(mine) for i, mine in ends.items()]
        gather(refs, [self.names[i] for i in ends], "KV receive", self.timeout_s)

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        ends = self._ends(list(kv.parts), lambda p: p.dst)
        refs = [a.kv_import.remote(ops, kv.request_id, kv.start, ends.get(i, [])) for i, a in enumerate(self.actors)]
        return all(self._gather(refs, "KV import"))

    def close_links(self, prefix: str) -> None:
        self._gather([a.kv_close.options(concurrency_group=KV_GROUP).remote(prefix) for a in self.actors],
                     "KV link close")

    @staticmethod
    def _ends(items: list, stage_of) -> dict[int, list]:
        """`items` (links or parts) by the stage that is their end here."""
        out: dict[int, list] = {}
        for item in items:
            out.setdefault(stage_of(item), []).append(item)
        return out

    def _gather(self, refs: list[ray.ObjectRef], what: str) -> list:
        return gather(refs, self.names, what, self.timeout_s)


class GroupStages(RayStages):
    """An EasySpec draft group (actors/spec/draft_group.py) as one stage: every member runs each call, rank 0
    (the first actor) returns the logits; its layers are the whole draft's. Its KV is spread over the group and
    stays there: a migration rebuilds it at the destination (the draft catches up)."""

    exports_kv = False
    kv_links = False
    replicated_cache = True

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], layer_ids: Sequence[int],
                 timeout_s: float) -> None:
        super().__init__(actors, names, [tuple(layer_ids)] + [()] * (len(actors) - 1), timeout_s)
        self.layer_ids = [tuple(layer_ids)]

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        return self._gather([a.step.remote(ops, chunks, parallel) for a in self.actors], "step")[0]

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """Rank 0's (used, free) blocks; every member replays the same ops, so each holds the same block count."""
        usage = self._gather([a.cache_usage.remote(ops) for a in self.actors], "cache usage")
        if len(set(usage)) > 1:
            raise ShardFailure(f"cache usage: the draft group's members disagree: {usage}")
        return usage[:1]

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        raise NotImplementedError("a layer-parallel draft's KV is spread over its group; it is rebuilt, not moved")

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        raise NotImplementedError("a layer-parallel draft's KV is spread over its group; it is rebuilt, not moved")


def gather(refs: list[ray.ObjectRef], names: Sequence[str], what: str, timeout_s: float,
           grace_s: float = 2.0) -> list:
    """Every call's result, in order; ShardFailure naming the actor as soon as one fails, or at the deadline.

    After a first failure the other calls get `grace_s` more to report theirs, so that the message names the
    actor that died (the root cause) rather than a neighbour whose transfer to it failed.
    """
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    failures: list[tuple[bool, str]] = []  # (died, message)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            if failures:
                break
            late = ", ".join(names[index[r]] for r in pending)
            raise ShardFailure(f"{what}: no answer from {late} within {timeout_s:g} s")
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref, timeout=0)
            except RayActorError as e:
                failures.append((True, f"{what}: {names[index[ref]]} died: {_reason(e)}"))
            except (RayError, GetTimeoutError) as e:
                failures.append((False, f"{what}: {names[index[ref]]} failed: {_reason(e)}"))
        if failures and not any(died for died, _ in failures):
            deadline = min(deadline, time.monotonic() + grace_s)
        elif failures:
            break
    if failures:
        raise ShardFailure(next((m for died, m in failures if died), failures[0][1]))
    return results


def _reason(e: Exception) -> str:
    """The original error of a failed remote call, in one line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
