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


class BlockPool:
    """Block accounting of a paged cache, without storage: free blocks, per-request block tables and lengths.

    Replaying the same calls on two pools of the same size gives the same block tables, which is what lets a
    driver keep a storage-free mirror of its shards' caches (actors/kv_ledger.py).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the scratch block)")
        self.block_size = block_size
        self.num_blocks = num_blocks - 1  # usable; the last is scratch
        self.scratch_block = num_blocks - 1
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._seqs: dict[str, _Seq] = {}

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._seqs

    def length(self, request_id: str) -> int:
        seq = self._seqs.get(request_id)
        return seq.length if seq else 0

    def block_table(self, request_id: str) -> list[int]:
        return self._seqs[request_id].blocks

    def extra_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Blocks a request must still get to hold `total_tokens` tokens."""
        seq = self._seqs.get(request_id)
        have = len(seq.blocks) if seq else 0
        return max(0, self.blocks_for(total_tokens) - have)

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        """Make room for `total_tokens` tokens of a request; False (and no change) if out of blocks."""
        need = self.extra_blocks_needed(request_id, total_tokens)
        if need > len(self._free):
            return False
        seq = self._seqs.setdefault(request_id, _Seq())
        seq.blocks.extend(self._free.pop() for _ in range(need))
        return True

    def crop(self, request_id: str, length: int) -> None:
        """Keep the first `length` tokens of a request (rejected drafts go) and free unused blocks."""
        seq = self._seqs[request_id]
        if length > seq.length:
            raise ValueError(f"cannot crop {request_id} to {length}: it holds {seq.length} tokens")
        seq.length = length
        keep = self.blocks_for(length)
        self._free.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted). Unknown ids are a no-op."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def set_length(self, request_id: str, length: int) -> None:
        """Record that KV up to `length` tokens is written (after a forward wrote it)."""
        seq = self._seqs[request_id]
        if self.blocks_for(length) > len(seq.blocks):
            raise ValueError(f"{request_id}: length {length} exceeds its reserved blocks")
        seq.length = length


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
        """K, V of every slot of the given block tables (B, nb): each (B, nb * block_size, kvh, hd)."""
        i = self._index[layer]
        b, nb = block_tables.shape
        k = self.k[i][block_tables].view(b, nb * self.block_size, *self.k.shape[-2:])
        v = self.v[i][block_tables].view(b, nb * self.block_size, *self.v.shape[-2:])
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
