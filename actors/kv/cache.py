"""Paged KV cache of one shard: fixed-size blocks, per-request block tables, crop, export and import.

Storage per layer is a pool of blocks, K and V each of shape (num_blocks, block_size, kv_heads,
head_dim), as in vLLM's PagedAttention (Kwon et al., SOSP '23). A request owns a list of blocks (its
block table) and a length in tokens; slot `s` of a request lives in block `table[s // block_size]`
at offset `s % block_size`. The last block of the pool is reserved as a scratch block that padded
positions of a batch write into, so a batched write needs no masking.

Running out of blocks is an expected condition: `reserve` returns False and changes nothing; the
engine then queues or preempts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVExport:
    """KV of one request's token range [start, end) for a set of layers, as plain tensors."""

    request_id: str
    layer_ids: tuple[int, ...]
    start: int
    end: int
    k: torch.Tensor  # (L, end - start, kv_heads, head_dim)
    v: torch.Tensor  # (L, end - start, kv_heads, head_dim)


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written
    named: int = 0  # leading blocks named (committed to the prefix cache): never cropped, never written again


@dataclass
class PrefixEvents:
    """Names of the blocks cached and evicted since the last `take_events` (what the router's index is fed), each
    under its latest change only (a name evicted and cached again is stored), so the two are applied in any order.
    `lost`: more changed than the pool keeps (nobody took them for long): only a snapshot tells what it holds."""

    stored: dict[int, None] = field(default_factory=dict)  # ordered sets
    removed: dict[int, None] = field(default_factory=dict)
    lost: bool = False

    def record(self, name: int, stored: bool) -> None:
        (self.removed if stored else self.stored).pop(name, None)
        (self.stored if stored else self.removed)[name] = None


class BlockPool:
    """Block accounting of a paged cache, without storage: free blocks, per-request block tables and lengths, and
    the prefix cache (automatic prefix caching, as in vLLM; blocks named by cluster/prefix.py).

    A full block whose KV is final can be named (`commit`): its name is the hash of every token up to its end.
    Named blocks are shared: `match` starts a new request with the named blocks that begin its prompt, each
    reference-counted. A named block whose last holder lets go stays cached (evictable) and is reused, least
    recently released first, only when no unnamed block is free; a request's tail blocks are released before its
    head, so a cached chain loses its tail first. A named block is full and lies before its holders' lengths, so
    nothing ever writes into it: a request writes only at or after its length (appends, drafts), and crops only
    back to a length at or after its named prefix.

    Replaying the same calls on two pools of the same size gives the same block tables, which is what lets a
    driver keep a storage-free mirror of its shards' caches (actors/kv/ledger.py).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the scratch block)")
        self.block_size = block_size
        self.num_blocks = num_blocks - 1  # usable; the last is scratch
        self.scratch_block = num_blocks - 1
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # unnamed; pop() gives low ids first
        self._seqs: dict[str, _Seq] = {}
        self._refs: list[int] = [0] * self.num_blocks  # requests holding each block
        self._name: dict[int, int] = {}  # block -> its name, for named blocks
        self._block: dict[int, int] = {}  # name -> the block that holds it
        self._cached: OrderedDict[int, None] = OrderedDict()  # named blocks no request holds, least recent first
        self.prefix = PrefixEvents()
        self.capacity_tokens = self.num_blocks * block_size  # the most one request can hold (CacheConfig's)
        self.max_events = 4 * num_blocks  # changes kept for `take_events`; past it they are dropped (`lost`)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation may take: unnamed free ones and cached ones (evicted on use)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a named prefix (reused by a request that starts with it)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._seqs

    def length(self, request_id: str) -> int:
        seq = self._seqs.get(request_id)
        return seq.length if seq else 0

    def block_table(self, request_id: str) -> list[int]:
        return self._seqs[request_id].blocks

    def named_blocks(self, request_id: str) -> int:
        """Leading blocks of a request that are named (shared with the prefix cache)."""
        seq = self._seqs.get(request_id)
        return seq.named if seq else 0

    def extra_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Blocks a request must still get to hold `total_tokens` tokens."""
        seq = self._seqs.get(request_id)
        have = len(seq.blocks) if seq else 0
        return max(0, self.blocks_for(total_tokens) - have)

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        """Make room for `total_tokens` tokens of a request; False (and no change) if out of blocks."""
        need = self.extra_blocks_needed(request_id, total_tokens)
        if need > self.num_free_blocks:
            return False
        seq = self._seqs.setdefault(request_id, _Seq())
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            seq.blocks.append(block)
        return True

    def crop(self, request_id: str, length: int) -> None:
        """Keep the first `length` tokens of a request (rejected drafts go) and free unused blocks."""
        seq = self._seqs[request_id]
        if length > seq.length:
            raise ValueError(f"cannot crop {request_id} to {length}: it holds {seq.length} tokens")
        if length < seq.named * self.block_size:
            raise ValueError(f"cannot crop {request_id} to {length}: its first {seq.named} blocks are shared")
        seq.length = length
        keep = self.blocks_for(length)
        for block in reversed(seq.blocks[keep:]):
            self._release(block)
        del seq.blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted). Unknown ids are a no-op. Named blocks
        stay cached; the tail goes first, so the head of a chain outlives its tail."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            for block in reversed(seq.blocks):
                self._release(block)

    def set_length(self, request_id: str, length: int) -> None:
        """Record that KV up to `length` tokens is written (after a forward wrote it)."""
        seq = self._seqs[request_id]
        if self.blocks_for(length) > len(seq.blocks):
            raise ValueError(f"{request_id}: length {length} exceeds its reserved blocks")
        seq.length = length

    # ---- the prefix cache -------------------------------------------------------------------
    def match(self, request_id: str, names: Sequence[int]) -> int:
        """Start a request that holds nothing here with the cached blocks named by the leading `names` of its
        prompt (cluster/prefix.py); returns the tokens they hold (its length). The caller leaves at least its last
        prompt token out of `names`, so the forward that emits its first token has a token to run."""
        if request_id in self._seqs:
            raise ValueError(f"{request_id} already holds KV here: only a request that starts can reuse a prefix")
        seq = _Seq()
        for name in names:
            block = self._block.get(name)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
            seq.blocks.append(block)
        seq.named = len(seq.blocks)
        seq.length = seq.named * self.block_size
        if seq.blocks:
            self._seqs[request_id] = seq
        return seq.length

    def commit(self, request_id: str, names: Sequence[int]) -> None:
        """Name the request's leading blocks by `names` (one per full block, its KV final: the request's own
        accepted tokens); those already named are skipped. A block whose name another block already holds stays
        private: the cache keeps one block per name."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if len(names) * self.block_size > seq.length:
            raise ValueError(f"{request_id}: {len(names)} blocks named but only {seq.length} tokens written")
        for i in range(seq.named, len(names)):
            block, name = seq.blocks[i], names[i]
            if name not in self._block and block not in self._name:
                self._name[block], self._block[name] = name, block
                self._event(name, stored=True)
        seq.named = max(seq.named, len(names))

    def take_events(self) -> PrefixEvents:
        """Names cached and evicted since the last call (and whether some were lost)."""
        out, self.prefix = self.prefix, PrefixEvents()
        return out

    def _event(self, name: int, stored: bool) -> None:
        """Record a change for `take_events`, within `max_events` (an engine nobody polls keeps no growing record)."""
        if len(self.prefix.stored) + len(self.prefix.removed) >= self.max_events:
            self.prefix = PrefixEvents(lost=True)
        if not self.prefix.lost:
            self.prefix.record(name, stored)

    def cached_names(self) -> list[int]:
        """Every name this pool holds (held or cached): a snapshot for the router's index."""
        return list(self._block)

    def _take(self) -> int:
        """A free block for a new use: an unnamed one, else the least recently released cached one (evicted)."""
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)
        name = self._name.pop(block)
        del self._block[name]
        self._event(name, stored=False)
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._name:
                self._cached[block] = None
            else:
                self._free.append(block)


class KVCache(BlockPool):
    """Paged KV storage for the layers `layer_ids` of one model shard."""

    def __init__(
        self,
        layer_ids: list[int],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_blocks, block_size)
        self.layer_ids = list(layer_ids)
        shape = (len(layer_ids), num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, NB, BS, kvh, hd)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, NB, BS, kvh, hd)
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}

    @property
    def device(self) -> torch.device:
        return self.k.device

    # ---- data -------------------------------------------------------------------------------
    def slot_list(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end) of a request, as plain ints."""
        table, bs = self._seqs[request_id].blocks, self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (end-start,) of token positions [start, end) of a request, on the cache's device."""
        return torch.tensor(self.slot_list(request_id, start, end), dtype=torch.long, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V of shape (N, kvh, hd) at flat slots (N,) of one layer."""
        i = self._index[layer]
        self.k[i].view(-1, *self.k.shape[-2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[i].view(-1, *self.v.shape[-2:]).index_copy_(0, slots, v.to(self.v.dtype))

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V storage as flat slots, views: each (num_blocks * block_size, kvh, hd)."""
        i = self._index[layer]
        return self.k[i].view(-1, *self.k.shape[-2:]), self.v[i].view(-1, *self.v.shape[-2:])

    def span(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of `length` consecutive flat slots from `start` of one layer, as views (no copy): each
        (length, kvh, hd). For a request whose blocks are consecutive in the pool (AttentionMetadata.span)."""
        i = self._index[layer]
        return (self.k[i].view(-1, *self.k.shape[-2:])[start:start + length],
                self.v[i].view(-1, *self.v.shape[-2:])[start:start + length])

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of every slot of the given block tables (B, nb): each (B, nb * block_size, kvh, hd).

        index_select, not advanced indexing: on this CPU `k[tables]` over a written pool cost 0.5-7 ms per call (a
        decode step calls it once per layer), index_select 0.01-0.02 ms (the prefix cache's shared blocks make a
        block table non-consecutive, so a single sequence takes this path too)."""
        i = self._index[layer]
        b, nb = block_tables.shape
        flat = block_tables.reshape(-1)  # (B * nb,)
        k = self.k[i].index_select(0, flat).view(b, nb * self.block_size, *self.k.shape[-2:])
        v = self.v[i].index_select(0, flat).view(b, nb * self.block_size, *self.v.shape[-2:])
        return k, v

    def export(self, request_id: str, start: int = 0, end: int | None = None) -> KVExport:
        """Copy out the KV of tokens [start, end) of a request for every layer of this shard."""
        seq = self._seqs[request_id]
        end = seq.length if end is None else end
        if not 0 <= start <= end <= seq.length:
            raise ValueError(f"{request_id}: range [{start}, {end}) outside its {seq.length} tokens")
        slots = self.slots(request_id, start, end)
        flat = (len(self.layer_ids), -1, *self.k.shape[-2:])
        return KVExport(
            request_id=request_id,
            layer_ids=tuple(self.layer_ids),
            start=start,
            end=end,
            k=self.k.view(flat)[:, slots].clone(),
            v=self.v.view(flat)[:, slots].clone(),
        )

    def import_(self, export: KVExport) -> bool:
        """Write an exported range into this cache, appending at the request's current length.

        The export must start where this cache's copy of the request ends (a fresh request starts
        at 0), so ranges can be streamed in stages. Returns False if out of blocks.
        """
        if tuple(self.layer_ids) != export.layer_ids:
            raise ValueError(f"export holds layers {export.layer_ids}, this cache {self.layer_ids}")
        have = self.length(export.request_id)
        if export.start != have:
            raise ValueError(f"{export.request_id}: export starts at {export.start}, cache holds {have}")
        if not self.reserve(export.request_id, export.end):
            return False
        slots = self.slots(export.request_id, export.start, export.end)
        flat = (len(self.layer_ids), -1, *self.k.shape[-2:])
        self.k.view(flat)[:, slots] = export.k.to(self.k.device, self.k.dtype)  # from any device (a KV channel: host)
        self.v.view(flat)[:, slots] = export.v.to(self.v.device, self.v.dtype)
        self._seqs[export.request_id].length = export.end
        return True


def reshard(exports: Sequence[KVExport], layer_ids: Sequence[Sequence[int]]) -> list[KVExport]:
    """Regroup exports of one request's token range by layer into the stages `layer_ids` (any split to any split)."""
    if not exports:
        raise ValueError("nothing to import")
    first = exports[0]
    if any((e.request_id, e.start, e.end) != (first.request_id, first.start, first.end) for e in exports):
        raise ValueError("exports of different requests or token ranges cannot be merged")
    if len(exports) == len(layer_ids) and all(tuple(e.layer_ids) == tuple(ids) for e, ids in zip(exports, layer_ids)):
        return list(exports)  # already split this way: no copy
    k = {layer: e.k[i] for e in exports for i, layer in enumerate(e.layer_ids)}  # layer -> (T, kvh, hd)
    v = {layer: e.v[i] for e in exports for i, layer in enumerate(e.layer_ids)}
    missing = sorted({i for ids in layer_ids for i in ids} - k.keys())
    if missing:
        raise ValueError(f"{first.request_id}: the exports lack layers {missing}")
    return [
        KVExport(first.request_id, tuple(ids), first.start, first.end,
                 torch.stack([k[i] for i in ids]), torch.stack([v[i] for i in ids]))  # each (L, T, kvh, hd)
        for ids in layer_ids
    ]
