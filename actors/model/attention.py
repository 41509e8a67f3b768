"""One attention over the paged KV cache for the generic path: write the new K, V, then attend with the layer's own
scaling, sliding window, logit softcap and sinks.

What a layer passes is what transformers' attention interface hands an attention function (the layer's `scaling`,
`sliding_window`, `softcap` as Gemma 2 does, `s_aux` sinks as gpt-oss does); the maths follows each family's own
eager attention in transformers: scores = q k^T * scaling, softcap * tanh(scores / softcap), masked, a sink logit
per head joined to the softmax and dropped after it (gpt-oss, arXiv 2508.10925; the "attention sink" of Xiao et al.,
arXiv 2309.17453). A prefill chunk without softcap and sinks is one SDPA call. Shape legend as in actors/model/layers.py:
N new tokens (packed), B sequences, T new tokens per sequence (padded), S cached slots per sequence (padded),
nh query heads, kvh KV heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.kv.cache import KVCache
from actors.model.metadata import AttentionMetadata


SMALL_T = 16  # at most this many query rows per sequence: the matmul path, not SDPA (see _attend)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention asks for beyond q, k, v (as its module passes it through the interface)."""

    layer: int  # the model's layer id: which of the cache's layers holds its K, V
    scaling: float  # the factor on q k^T (hd ** -0.5 for most; Gemma's query_pre_attn_scalar, Granite's multiplier)
    sliding_window: int | None = None  # keys within the last `sliding_window` positions (the query's own included)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # (nh,) a per-head logit that takes softmax mass and no value (gpt-oss)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerAttention, meta: AttentionMetadata,
           cache: KVCache) -> torch.Tensor:
    """Write k, v (N, kvh, hd) of the new tokens at `meta.slots` of layer `spec.layer`, then attend: q (N, nh, hd)
    -> (N, nh, hd) in q's dtype. One sequence on consecutive blocks reads its K, V in place (`meta.span`); a batch
    gathers its block tables into the padded (B, T) layout (padded queries see slot 0 only and are dropped)."""
    cache.write(spec.layer, meta.slots, k, v)
    nh, hd = q.shape[1], q.shape[2]
    if meta.span is not None:
        start, length = meta.span
        keys, values = cache.span(spec.layer, start, length)  # (S, kvh, hd) each, views
        out = _attend(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                      meta.span_mask(spec.sliding_window), spec)  # (1, nh, T, hd)
        return out[0].transpose(0, 1)
    keys, values = cache.gather(spec.layer, meta.block_tables)  # (B, S, kvh, hd) each
    b, t = meta.padded_shape
    if meta.packed_is_padded:  # every sequence brings T tokens: the packed rows are the padded layout
        q_pad = q
    else:
        q_pad = q.new_zeros(b * t, nh, hd)
        q_pad[meta.pad_index] = q
    out = _attend(q_pad.view(b, t, nh, hd).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                  meta.mask(spec.sliding_window), spec)  # (B, nh, T, hd)
    out = out.transpose(1, 2).reshape(b * t, nh, hd)
    return out if meta.packed_is_padded else out[meta.pad_index]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            spec: LayerAttention) -> torch.Tensor:
    """q (B, nh, T, hd), keys and values (B, kvh, S, hd), mask (B, 1, T, S) boolean or None -> (B, nh, T, hd).

    A prefill chunk without softcap or sinks is one SDPA call. A few query rows (decodes, verifications), or a
    layer with softcap or sinks, take two batched matmuls per KV head in fp32 with the query heads of a group as
    rows (as the native path's span attention does: on the CPU several times faster than SDPA's flash kernel at a
    few rows, docs/benchmarks.md), no copy of the keys per query head."""
    b, nh, t, hd = q.shape
    kvh, length = keys.shape[1], keys.shape[2]
    if spec.softcap is None and spec.sinks is None and t > SMALL_T:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=spec.scaling,
                                              enable_gqa=nh != kvh)
    qg = q.reshape(b, kvh, (nh // kvh) * t, hd).float()  # query head h = kv * g + j reads KV head kv
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)).view(b, nh, t, length) * spec.scaling  # (B, nh, T, S)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = spec.sinks.float().view(1, nh, 1, 1).expand(b, nh, t, 1)  # (B, nh, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    out = torch.matmul(probs.reshape(b, kvh, (nh // kvh) * t, length), values.float())  # (B, kvh, g*T, hd)
    return out.view(b, nh, t, hd).to(q.dtype)
