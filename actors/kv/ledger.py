"""A driver's storage-free mirror of its shards' KV caches: block accounting that records the ops to replay.

The engine and scheduler reserve, crop, free, match and commit KV on the driver; each op that changes the accounting is
recorded as a `CacheOp` and shipped to every shard with the next call that reaches it (a step, an export,
an import). Every shard replays the same ops, in the same order, on a `BlockPool` of the same size as the
ledger's, so its block tables stay identical to the ledger's and its usage is known without asking it.
Lengths grow by forwards, which every shard applies itself; the ledger applies them after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.kv.cache import BlockPool


@dataclass(frozen=True)
class Reserve:
    """Room for `total_tokens` tokens of a request (BlockPool.reserve)."""

    request_id: str
    total_tokens: int

    def apply(self, pool: BlockPool) -> None:
        if not pool.reserve(self.request_id, self.total_tokens):
            raise RuntimeError(f"shard cache out of step with its ledger: no room for {self.request_id}")


@dataclass(frozen=True)
class Crop:
    """Keep the first `length` tokens of a request (BlockPool.crop)."""

    request_id: str
    length: int

    def apply(self, pool: BlockPool) -> None:
        pool.crop(self.request_id, self.length)


@dataclass(frozen=True)
class Free:
    """Release every block of a request (BlockPool.free)."""

    request_id: str

    def apply(self, pool: BlockPool) -> None:
        pool.free(self.request_id)


@dataclass(frozen=True)
class Match:
    """Start a request with the cached blocks its prompt's leading names find (BlockPool.match)."""

    request_id: str
    names: tuple[int, ...]

    def apply(self, pool: BlockPool) -> None:
        pool.match(self.request_id, self.names)


@dataclass(frozen=True)
class Commit:
    """Name a request's leading full blocks (BlockPool.commit)."""

    request_id: str
    names: tuple[int, ...]

    def apply(self, pool: BlockPool) -> None:
        pool.commit(self.request_id, self.names)


CacheOp = Reserve | Crop | Free | Match | Commit


def replay(ops: list[CacheOp], pool: BlockPool) -> None:
    """Apply `ops` in order to a shard's cache."""
    for op in ops:
        op.apply(pool)


class KVLedger(BlockPool):
    """Block accounting of a sharded cache that records every change since the last `drain`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._ops: list[CacheOp] = []

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        new = not self.has(request_id)
        grows = self.extra_blocks_needed(request_id, total_tokens) > 0
        ok = super().reserve(request_id, total_tokens)
        if ok and (new or grows):  # a reserve that changes nothing is not worth shipping
            self._ops.append(Reserve(request_id, total_tokens))
        return ok

    def crop(self, request_id: str, length: int) -> None:
        super().crop(request_id, length)
        self._ops.append(Crop(request_id, length))

    def free(self, request_id: str) -> None:
        if self.has(request_id):
            super().free(request_id)
            self._ops.append(Free(request_id))

    def match(self, request_id: str, names) -> int:
        got = super().match(request_id, names)
        if got:  # a miss changes nothing a shard must replay
            self._ops.append(Match(request_id, tuple(names[: got // self.block_size])))
        return got

    def commit(self, request_id: str, names) -> None:
        before = self.named_blocks(request_id)
        super().commit(request_id, names)
        if self.named_blocks(request_id) > before:
            self._ops.append(Commit(request_id, tuple(names)))

    @property
    def pending(self) -> int:
        """Ops recorded and not yet drained."""
        return len(self._ops)

    def drain(self) -> list[CacheOp]:
        """The ops recorded since the last drain, oldest first; the record starts empty again."""
        ops, self._ops = self._ops, []
        return ops
