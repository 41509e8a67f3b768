"""The router's index of which instance holds which KV blocks, for cache-aware dispatch (pure, no Ray).

Instances name their cached blocks by chained hashes (cluster/prefix.py) and report the changes in numbered
batches (`CacheEvents`: blocks stored, blocks evicted; or a snapshot of all they hold, after a start or when the
router lost track). The index applies each instance's batches in their order, whatever order they arrive in: an
early batch waits for the ones before it, and an old one is dropped. So the same events give the same index.

Between a request being routed and its instance reporting the blocks it cached, a burst of requests with the
same prefix would see no holder; `routed` therefore records the request's blocks at its instance at once,
provisionally: an event confirms them, and unconfirmed ones expire after `provisional_s` (the request may have
been aborted before its prefill). This is the precise event-fed kind of index (as llm-d's precise prefix-cache
scorer and Dynamo's KV router keep) with the routed-prompt guess of SGLang's cache-aware router to bridge the gap.

Memory is bounded: at most `max_entries` (instance, block) pairs; past that the least recently used blocks are
forgotten fleet-wide (routing then under-estimates a hit, it never invents one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from cluster.prefix import BlockHash


@dataclass(frozen=True)
class CacheEvents:
    """One batch of an instance's prefix-cache changes, numbered 1, 2, ... per instance incarnation."""

    seq: int
    stored: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    snapshot: bool = False  # `stored` is everything the instance holds now (replace, do not add); a restarted
    # instance's first batch is a snapshot, which also resets the numbering to this batch's seq


class EventLog:
    """An instance's side of the protocol: numbers its batches 1, 2, ... and sends a snapshot (every block it holds)
    first, when the router asks (it restarted, or lost a batch), or when the instance itself lost changes."""

    def __init__(self) -> None:
        self.seq = 0

    def batch(self, stored: Sequence[BlockHash], removed: Sequence[BlockHash], lost: bool, snapshot: bool,
              held: Callable[[], Iterable[BlockHash]]) -> CacheEvents:
        """The next batch: the changes since the last (`stored`, `removed`), or with `snapshot` (or `lost`, or as the
        first batch) everything `held()` gives."""
        self.seq += 1
        if snapshot or lost or self.seq == 1:
            return CacheEvents(self.seq, tuple(held()), snapshot=True)
        return CacheEvents(self.seq, tuple(stored), tuple(removed))


class PrefixIndex:
    """Block hash -> the instances that hold it, fed by each instance's `CacheEvents`."""

    def __init__(self, max_entries: int = 1_000_000, provisional_s: float = 10.0, max_pending: int = 64) -> None:
        self.max_entries = max_entries
        self.provisional_s = provisional_s
        self.max_pending = max_pending  # out-of-order batches kept per instance before it is resynchronised
        self._holders: dict[BlockHash, set[str]] = {}
        self._held: dict[str, set[BlockHash]] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
        self._entries = 0
        self._next_seq: dict[str, int] = {}  # the batch each instance's next apply must have
        self._pending: dict[str, dict[int, CacheEvents]] = {}
        self._provisional: dict[tuple[str, BlockHash], float] = {}  # (instance, block) -> expiry time
        self.needs_snapshot: set[str] = set()  # instances whose batches were lost: ask them for a snapshot

    # ---- events -------------------------------------------------------------------------------------
    def apply(self, instance_id: str, batch: CacheEvents) -> None:
        """Take one batch from `instance_id`, in its order (buffering one that comes early)."""
        if batch.snapshot:
            self._pending[instance_id] = {s: b for s, b in self._pending.get(instance_id, {}).items() if s > batch.seq}
            self._replace(instance_id, batch.stored)
            self._next_seq[instance_id] = batch.seq + 1
            self.needs_snapshot.discard(instance_id)
        elif instance_id not in self._next_seq:  # never synchronised (e.g. this router just started)
            self.needs_snapshot.add(instance_id)
            return
        elif batch.seq < self._next_seq[instance_id]:
            return  # already applied
        else:
            pending = self._pending.setdefault(instance_id, {})
            pending[batch.seq] = batch
            if len(pending) > self.max_pending:  # a batch in the gap is lost: start again from a snapshot
                pending.clear()
                self.needs_snapshot.add(instance_id)
                return
        self._drain(instance_id)

    def _drain(self, instance_id: str) -> None:
        pending = self._pending.get(instance_id, {})
        while (batch := pending.pop(self._next_seq[instance_id], None)) is not None:
            self._add(instance_id, batch.stored, provisional_until=None)
            for h in batch.removed:
                self._remove(instance_id, h)
            self._next_seq[instance_id] += 1

    def routed(self, instance_id: str, hashes: Iterable[BlockHash], now: float) -> None:
        """A request with these blocks was just sent to `instance_id`: count them there until an event confirms
        them or `provisional_s` passes."""
        self._add(instance_id, hashes, provisional_until=now + self.provisional_s)

    def expire(self, now: float) -> int:
        """Forget provisional blocks no event confirmed in time; how many went."""
        gone = [key for key, until in self._provisional.items() if until <= now]
        for instance_id, h in gone:
            self._remove(instance_id, h)
        return len(gone)

    def drop_instance(self, instance_id: str) -> None:
        """An instance left (removed, dead): its blocks go with it."""
        self._replace(instance_id, ())
        self._held.pop(instance_id, None)
        self._next_seq.pop(instance_id, None)
        self._pending.pop(instance_id, None)
        self.needs_snapshot.discard(instance_id)

    def wants_snapshot(self, instance_id: str) -> bool:
        """Whether the next batch asked of `instance_id` should be a snapshot: it was never synchronised, a batch was
        lost, or one is missing before those that came (a router that pulls batches in order has lost it)."""
        return (instance_id in self.needs_snapshot or instance_id not in self._next_seq
                or bool(self._pending.get(instance_id)))

    # ---- queries ------------------------------------------------------------------------------------
    def deepest(self, hashes: Sequence[BlockHash]) -> Iterator[tuple[int, set[str]]]:
        """The holders of the chain `hashes`'s blocks, deepest block first: (n, the instances holding its n-th
        block). A cache holds the leading blocks of a chain (it evicts a chain's tail first), so an instance's
        first appearance says how many leading blocks it can reuse; it appears again at every shallower block it
        holds (consumers skip those: building the difference would cost as much as the set). Lazy: a caller that
        found what it needs among the deepest holders costs nothing more. The sets are the index's own: read only."""
        touched = False
        for i in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[i])
            if holders:
                if not touched:
                    self._touch(hashes[: i + 1])
                    touched = True
                yield i + 1, holders

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Every holder of the chain `hashes` -> how many leading blocks it holds (all depths: O(holders))."""
        out: dict[str, int] = {}
        for depth, instances in self.deepest(hashes):
            for instance in instances:
                out.setdefault(instance, depth)
        return out

    def holds(self, instance_id: str) -> frozenset[BlockHash]:
        return frozenset(self._held.get(instance_id, ()))

    def __len__(self) -> int:
        """(instance, block) pairs held."""
        return self._entries

    def snapshot_of(self) -> dict[str, frozenset[BlockHash]]:
        """Every instance's blocks (tests compare indexes by this)."""
        return {i: frozenset(hs) for i, hs in self._held.items() if hs}

    # ---- internals ----------------------------------------------------------------------------------
    def _add(self, instance_id: str, hashes: Iterable[BlockHash], provisional_until: float | None) -> None:
        hashes = list(hashes)
        held = self._held.setdefault(instance_id, set())
        for h in hashes:
            key = (instance_id, h)
            if provisional_until is None:
                self._provisional.pop(key, None)
            elif h not in held or key in self._provisional:
                self._provisional[key] = provisional_until
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(instance_id)
                self._entries += 1
        self._touch(hashes)
        while self._entries > self.max_entries and self._lru:
            oldest, _ = self._lru.popitem(last=False)
            for holder in list(self._holders.get(oldest, ())):
                self._remove(holder, oldest)

    def _touch(self, chain: Sequence[BlockHash]) -> None:
        """Mark blocks used, the chain's head last: the least recently used go first, and a tail before its head."""
        for h in reversed(chain):
            if h in self._holders:
                self._lru[h] = None
                self._lru.move_to_end(h)

    def _remove(self, instance_id: str, h: BlockHash) -> None:
        self._provisional.pop((instance_id, h), None)
        held = self._held.get(instance_id)
        if held is None or h not in held:
            return
        held.discard(h)
        holders = self._holders[h]
        holders.discard(instance_id)
        self._entries -= 1
        if not holders:
            del self._holders[h]
            self._lru.pop(h, None)

    def _replace(self, instance_id: str, hashes: Iterable[BlockHash]) -> None:
        keep = set(hashes)
        for h in list(self._held.get(instance_id, ())):
            if h not in keep:
                self._remove(instance_id, h)
        self._add(instance_id, keep, provisional_until=None)
