"""Decoder-layer maths the project runs itself: RMSNorm, RoPE attention over the paged cache, MLP, MoE.

Weights come from the transformers model (shared, never copied); the computation is ours so that
layer ranges, layer-parallel drafting and expert parallelism can wrap it. Shape legend:
N new tokens of the batch (packed), B sequences, T new tokens per sequence (padded, attention only),
S cached slots per sequence (padded), H hidden size, nh query heads, kvh KV heads, hd head dim,
E experts, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv_cache import KVCache
from actors.model.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32, in the same order as Llama's reference."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), half-rotation layout.

    x: (N, heads, hd); cos, sin: (N, hd).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class Attention:
    """Self-attention weights of one layer (q/k/v/o projections, biases as the checkpoint has them)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    # tensor-parallel slice of the heads (actors/moe/shuffle.py): the local KV head each local query head reads,
    # (nh,); None: grouped-query attention's own grouping, nh / kvh query heads per KV head
    kv_map: torch.Tensor | None = None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) -> q (N, nh, hd), k and v (N, kvh, hd), RoPE applied to q and k."""
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return q, k, v

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """x: (N, H) -> (N, H). Writes this layer's K, V for the new tokens into the cache."""
        q, k, v = self.qkv(x, cos, sin)
        cache.write(layer, meta.slots, k, v)
        keys, values = cache.gather(layer, meta.block_tables)  # (B, S, kvh, hd) each
        if self.kv_map is not None:
            keys, values = keys[:, :, self.kv_map], values[:, :, self.kv_map]  # (B, S, nh, hd) each
        b, t = meta.padded_shape
        q_pad = q.new_zeros(b * t, self.num_heads, self.head_dim)
        q_pad[meta.pad_index] = q
        out = F.scaled_dot_product_attention(
            q_pad.view(b, t, self.num_heads, self.head_dim).transpose(1, 2),  # (B, nh, T, hd)
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask(self.sliding_window),  # (B, 1, T, S)
            enable_gqa=self.kv_map is None and self.num_heads != self.num_kv_heads,
        )  # (B, nh, T, hd)
        out = out.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim)[meta.pad_index]  # (N, nh*hd)
        return self.o_proj(out)


@dataclass
class DenseMLP:
    """Gated MLP: down(act(gate(x)) * up(x))."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act: nn.Module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class MoE:
    """Sparse mixture of experts (Mixtral, Qwen2-MoE): top-k routing, gated experts, optional shared expert.

    `route` and `experts` are separate so that expert parallelism can move tokens between them.
    """

    router: torch.Tensor  # (E, H)
    gate_up: torch.Tensor  # (E, 2I, H)
    down: torch.Tensor  # (E, H, I)
    top_k: int
    normalize_top_k: bool
    act: nn.Module
    weights_in_input_dtype: bool  # Qwen2-MoE casts routing weights to the activations' dtype; Mixtral does not
    shared: DenseMLP | None = None
    shared_gate: nn.Linear | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (N, H) -> weights (N, top_k) and expert ids (N, top_k)."""
        probs = F.softmax(F.linear(x, self.router).float(), dim=-1)  # (N, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's chosen experts. x: (N, H) -> (N, H)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)  # tokens routed to expert e, and at which top-k slot
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)  # (n, I) each
            y = F.linear(self.act(gate) * up, self.down[e])  # (n, H)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        weights, ids = self.route(flat)
        if self.weights_in_input_dtype:
            weights = weights.to(flat.dtype)
        out = self.experts(flat, weights, ids)
        if self.shared is not None:
            gate = torch.sigmoid(self.shared_gate(flat)) if self.shared_gate is not None else 1.0
            out = out + gate * self.shared(flat)
        return out.reshape(shape)


@dataclass
class DecoderLayer:
    """Pre-norm decoder layer: x + attn(norm(x)), then h + ffn(norm(h))."""

    index: int
    input_norm: torch.Tensor  # (H,)
    post_norm: torch.Tensor  # (H,)
    eps: float
    attn: Attention
    ffn: DenseMLP | MoE

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        h = x + self.attn(rms_norm(x, self.input_norm, self.eps), cos, sin, meta, cache, self.index)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))
