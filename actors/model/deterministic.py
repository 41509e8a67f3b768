"""Batch-invariant forward (`engine.deterministic`): every op gives a row the same bits whatever else is in the
forward (the k+1 positions of a verification, other requests, prefill chunks), so speculative output equals plain
decoding token for token in bf16 too (the approach of Thinking Machines' "Defeating Nondeterminism in LLM
Inference", 2025: fix each kernel's reduction order independently of the batch; docs/determinism.md).

Measured on this CPU (tests/unit/test_batch_invariance.py): torch's dense matmul (oneDNN) picks its blocking from
the number of rows, so a row's sums change with M (fp32 at every shape, bf16 at K = 1536); attention changes kernel
with the batch (our fused kernel for one sequence, SDPA over a padded gather for several). Elementwise ops, the
norms and our int4 kernel are row-invariant. Here:
- a linear map that is not our int4 kernel runs on fixed tiles of `TILE` rows (padded with zero rows), so every
  call has the same shape and a row's bits do not depend on M or on its place in the tile;
- attention runs per sequence and per query row over exactly the keys that row sees: our fused kernels (which
  compute each row alone, one row at a time or a prefill chunk's rows on tiles with the same bits per row:
  attention_backends.span_kernel) on the sequence's keys, else SDPA of one query row over its own keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv.cache import KVCache
from actors.model.attention_backends import Heads, span_kernel
from actors.model.metadata import AttentionMetadata
from actors.model.weights import Concat

TILE = 16  # rows per matmul call: one shape for every call (a decode pays 16 rows of compute, not of weight reads)


class Tiled(nn.Module):
    """`inner` (M, K) -> (M, N) computed on fixed tiles of `TILE` rows: row-invariant whatever inner's kernel does
    with M."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        m = x2.shape[0]
        x2 = F.pad(x2, (0, 0, 0, -m % TILE))  # (M padded to tiles, K)
        y = torch.cat([self.inner(tile) for tile in x2.split(TILE)])[:m]  # (M, N)
        return y.view(*shape[:-1], y.shape[-1])


def row_invariant(linear: nn.Module) -> nn.Module:
    """`linear` as it is where its kernel is row-invariant by construction (our int4 kernel sums each row alone in
    one order), else on fixed tiles. A fused projection whose parts are separate calls (`Concat`: a GGUF file's
    formats side by side, as Q4_K_M's q and k with a Q6_K v) is row-invariant when each part is."""
    if isinstance(linear, Tiled):
        return linear
    if isinstance(linear, Concat):  # a new module: the model's prepared one may serve a runner that is not invariant
        return Concat([row_invariant(p) for p in linear.parts])
    if getattr(linear, "own", None) is not None:
        linear.invariant = True  # every row on our kernel, never the dense path of a prefill
        return linear
    return Tiled(linear)


class DeterministicAttention:
    """The batch-invariant attention backend (actors/model/attention_backends.py): each query row over exactly the
    keys it sees, the same computation whatever the batch. `ops`: our CPU kernels where they run the layer (not a
    tensor-parallel slice), else None. Per call, from the step's block tables: one sequence on consecutive blocks
    runs our kernel in place; otherwise each sequence alone, on our kernel over a copy of its slots or SDPA per row."""

    def __init__(self, heads: Heads, ops: object | None) -> None:
        self.heads = heads
        self.ops = ops if heads.kv_map is None else None

    def write_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache, layer: int) -> torch.Tensor:
        """q (N, nh, hd), k, v (N, kvh, hd) -> (N, nh*hd); writes the new K, V into the cache."""
        fused, window, kv_map = self.ops, self.heads.sliding_window or 0, self.heads.kv_map
        if fused is not None and meta.span is not None:  # one sequence on consecutive blocks: in place, no copy
            kpool, vpool = cache.pools(layer)
            return span_kernel(fused, q.shape[0])(q, k, v, kpool, vpool, meta.slots, *meta.span, window)
        cache.write(layer, meta.slots, k, v)
        keys, values = cache.gather(layer, meta.block_tables)  # (B, S, kvh, hd) each
        if kv_map is not None:
            keys, values = keys[:, :, kv_map], values[:, :, kv_map]  # (B, S, nh, hd) each
        outs, offset = [], 0
        for b, (n, length) in enumerate(meta.seqs):
            qb, kb, vb = q[offset:offset + n], keys[b, :length].contiguous(), values[b, :length].contiguous()
            if fused is not None:  # the kernel computes each row alone; it rewrites the new K, V (same values)
                slots = torch.arange(length - n, length, device=q.device)
                outs.append(span_kernel(fused, n)(qb, k[offset:offset + n], v[offset:offset + n], kb, vb, slots, 0,
                                                  length, window))
            else:
                outs.extend(self._row(qb[i], kb, vb, length - n + i, window) for i in range(n))
            offset += n
        return torch.cat(outs)  # (N, nh*hd)

    def _row(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int) -> torch.Tensor:
        """One query row q (nh, hd) at position `pos` over keys, values (S, h, hd) [first, pos] -> (1, nh*hd)."""
        h = self.heads
        first = max(0, pos - window + 1) if window else 0
        out = F.scaled_dot_product_attention(
            q[None, :, None],  # (1, nh, 1, hd)
            keys[None, first:pos + 1].transpose(1, 2), values[None, first:pos + 1].transpose(1, 2),  # (1, h, s, hd)
            enable_gqa=h.kv_map is None and h.num_heads != h.num_kv_heads,
        )  # (1, nh, 1, hd)
        return out.reshape(1, -1)
