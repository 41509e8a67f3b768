"""Attention backends of the hand-written layers: each writes a layer's new K, V to the paged cache and attends.

A layer's backend is chosen once, when the layer is built (`layers.attention_backend`), from what does not change
while it runs: our CPU kernels or torch's ops, a tensor-parallel slice of the heads, deterministic mode; vLLM picks
its attention backend the same way when it builds the model. What a backend decides per call depends on the step's
own data (one sequence on consecutive blocks, one sequence on scattered ones, a batch), which only the step knows;
each backend's docstring says which. The batch-invariant backend is actors/model/deterministic.py's.

Shape legend as in actors/model/layers.py: N new tokens (packed), B sequences, T new tokens per sequence (padded),
S cached slots per sequence (padded), nh query heads, kvh KV heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from actors.kv.cache import KVCache
from actors.model.metadata import AttentionMetadata


@dataclass(frozen=True)
class Heads:
    """A layer's attention geometry, what every backend reads."""

    num_heads: int  # nh
    num_kv_heads: int  # kvh
    head_dim: int  # hd
    sliding_window: int | None
    # tensor-parallel slice of the heads (actors/moe/shuffle.py): the local KV head each local query head reads,
    # (nh,); None: grouped-query attention's own grouping, nh / kvh query heads per KV head
    kv_map: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """How one layer writes its new K, V and attends over the paged cache."""

    def write_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache, layer: int) -> torch.Tensor:
        """q (N, nh, hd), k and v (N, kvh, hd) of the new tokens -> attention output (N, nh*hd) in q's dtype; the
        new K, V are in layer `layer` of `cache` at `meta.slots` afterwards."""
        ...


class PaddedSdpa:
    """torch's SDPA over the batch's block tables gathered into the padded (B, T) layout (padded queries see slot 0
    only and are dropped). The only backend of a tensor-parallel slice of the heads (`kv_map`: each local query
    head's KV head picked from the gathered ones), and the batch path of the others."""

    def __init__(self, heads: Heads) -> None:
        self.heads = heads

    def write_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache, layer: int) -> torch.Tensor:
        cache.write(layer, meta.slots, k, v)
        keys, values = cache.gather(layer, meta.block_tables)  # (B, S, kvh, hd) each
        return self.padded(q, keys, values, meta)

    def padded(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q (N, nh, hd) over the gathered keys, values (B, S, kvh, hd) -> (N, nh*hd)."""
        h = self.heads
        if h.kv_map is not None:
            keys, values = keys[:, :, h.kv_map], values[:, :, h.kv_map]  # (B, S, nh, hd) each
        b, t = meta.padded_shape
        if meta.packed_is_padded:  # every sequence brings T tokens: the packed rows are the padded layout
            q_pad = q
        else:
            q_pad = q.new_zeros(b * t, h.num_heads, h.head_dim)
            q_pad[meta.pad_index] = q
        out = F.scaled_dot_product_attention(
            q_pad.view(b, t, h.num_heads, h.head_dim).transpose(1, 2),  # (B, nh, T, hd)
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask(h.sliding_window),  # (B, 1, T, S)
            enable_gqa=h.kv_map is None and h.num_heads != h.num_kv_heads,
        )  # (B, nh, T, hd)
        out = out.transpose(1, 2).reshape(b * t, h.num_heads * h.head_dim)  # (B*T, nh*hd)
        return out if meta.packed_is_padded else out[meta.pad_index]  # (N, nh*hd)


class SpanAttention(PaddedSdpa):
    """torch's ops where our kernels do not run. Per call: one sequence on consecutive blocks (`meta.span`, known
    only once the step's block tables are) reads its keys and values in place (`attend_span`); anything else is
    `PaddedSdpa`'s batch path."""

    def write_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache, layer: int) -> torch.Tensor:
        if meta.span is None:
            return super().write_and_attend(q, k, v, meta, cache, layer)
        cache.write(layer, meta.slots, k, v)
        return self.attend_span(q, cache, layer, meta)

    def attend_span(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one sequence whose blocks are consecutive in the pool: its keys and values are a slice
        of the layer's storage (no copy of the pool), exactly its S = start + T slots (no padding). q (T, nh, hd)
        -> (T, nh*hd). Two batched matmuls per KV head in fp32 (the query heads of a group as rows): at a few
        new tokens this is several times faster on the CPU than SDPA's flash kernel (docs/benchmarks.md)."""
        h = self.heads
        start, length = meta.span
        keys, values = cache.span(layer, start, length)  # (S, kvh, hd) each, views
        t, kvh, hd = q.shape[0], h.num_kv_heads, h.head_dim
        g = h.num_heads // kvh
        qh = q.view(t, kvh, g, hd).transpose(0, 1).reshape(kvh, t * g, hd).float()  # (kvh, T*g, hd)
        scores = torch.bmm(qh, keys.permute(1, 2, 0).float()).mul_(hd ** -0.5)  # (kvh, T*g, S)
        mask = meta.span_mask(h.sliding_window)  # (1, 1, T, S) or None
        if mask is not None:
            scores.view(kvh, t, g, length).masked_fill_(~mask[0, 0, :, None, :], float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1).float())  # (kvh, T*g, hd)
        return out.view(kvh, t, g, hd).transpose(0, 1).reshape(t, h.num_heads * hd).to(q.dtype)


# query rows from which a sequence's attention takes our tiled kernel (attention_cpu.cpp `chunk_attention`: each key
# and value row read once per tile of rows, span_attention's bits for every row) rather than span_attention
CHUNK_ROWS = 4


def span_kernel(ops: object, rows: int):  # noqa: ANN201 - one of torch's op objects
    """Our attention op for `rows` query rows of one sequence: `chunk_attention` for a chunk, `span_attention`
    for a decode step (the same bits either way)."""
    return ops.chunk_attention if rows >= CHUNK_ROWS else ops.span_attention


class FusedCpuAttention(PaddedSdpa):
    """Our CPU kernels (fused_cpu.cpp `span_attention`, attention_cpu.cpp `chunk_attention` for a chunk of rows:
    `span_kernel`; `ops` of the process's ISA). Per call, from the step's block
    tables: one sequence on consecutive blocks writes and attends in one call, in place in the pool; one sequence
    on blocks that are not consecutive (the prefix cache shares its leading ones) runs the same kernel over a copy
    of its S slots, so its output is bit for bit that of consecutive blocks; a batch takes `PaddedSdpa`'s path."""

    def __init__(self, heads: Heads, ops: object) -> None:
        super().__init__(heads)
        self.ops = ops  # torch.ops.specfleet_<isa>, its ops looked up at each call

    def write_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache, layer: int) -> torch.Tensor:
        window = self.heads.sliding_window or 0
        if meta.span is not None:  # write and attend, one call
            kpool, vpool = cache.pools(layer)
            return span_kernel(self.ops, q.shape[0])(q, k, v, kpool, vpool, meta.slots, *meta.span, window)
        cache.write(layer, meta.slots, k, v)
        keys, values = cache.gather(layer, meta.block_tables)  # (B, S, kvh, hd) each
        if len(meta.seqs) == 1:
            n, length = meta.seqs[0]
            slots = torch.arange(length - n, length, device=q.device)  # (T,)
            return span_kernel(self.ops, n)(q, k, v, keys[0, :length], values[0, :length], slots, 0, length, window)
        return self.padded(q, keys, values, meta)
