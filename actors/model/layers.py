"""Decoder-layer maths the project runs itself: RMSNorm, RoPE attention over the paged cache, MLP, MoE.

Weights come from the transformers model (shared, never copied); the computation is ours so that
layer ranges, layer-parallel drafting and expert parallelism can wrap it. Shape legend:
N new tokens of the batch (packed), B sequences, T new tokens per sequence (padded, attention only),
S cached slots per sequence (padded), H hidden size, nh query heads, kvh KV heads, hd head dim,
E experts, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv.cache import KVCache
from actors.model.metadata import AttentionMetadata
from actors.model.qlinear import DENSE_ROWS, Int4Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), one fused kernel accumulating in fp32 (in fp32 identical to Llama's
    reference; in bf16 it rounds once, after the weight, where the reference rounds before it). `fp32`: Gemma's form,
    x taken to fp32, scaled by an fp32 gain (its 1 + w, see gemma_gain) and rounded to x's dtype once, at the end."""
    if fp32:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)


def gemma_gain(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scales by 1 + w, computed in fp32 (transformers' Gemma3RMSNorm): the gain (D,) rms_norm takes
    with fp32=True."""
    return 1.0 + weight.detach().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), half-rotation layout.

    x: (N, heads, hd); cos, sin: (N, 1, hd) from RopeTable, sin with its first half negated, so that
    x * cos + rotate_half(x) * sin is x * cos + roll(x, hd / 2) * sin (the same products and sums).
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


class RopeTable:
    """cos and signed sin of every position up to the longest seen, computed once by the model's own rotary
    module (so any rope scaling it applies is kept) and then indexed per forward."""

    def __init__(self, rotary: nn.Module, dtype: torch.dtype, device: torch.device,
                 layer_type: str | None = None) -> None:
        self.rotary, self.dtype, self.device, self.layer_type = rotary, dtype, device, layer_type
        self.cos = self.sin = torch.empty(0, 1, 0, dtype=dtype, device=device)

    def __call__(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's positions (N,) -> cos, sin (N, 1, hd) each, sin's first half negated (see apply_rope)."""
        if meta.max_position >= self.cos.shape[0]:
            self._grow(meta.max_position + 1)
        return self.cos[meta.positions], self.sin[meta.positions]

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        pos = torch.arange(n, device=self.device)[None]  # (1, P)
        x = torch.empty(0, dtype=self.dtype, device=self.device)
        kind = () if self.layer_type is None else (self.layer_type,)  # Gemma 3's table of one layer type
        cos, sin = self.rotary(x, pos, *kind)  # (1, P, hd) each
        half = sin.shape[-1] // 2
        self.cos = cos[0, :, None]  # (P, 1, hd)
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)[:, None]  # (P, 1, hd)


@dataclass
class Attention:
    """Self-attention of one layer: a fused q/k/v projection (biases as the checkpoint has them) and o_proj."""

    qkv_proj: nn.Module  # (N, H) -> (N, (nh + 2 kvh) * hd): q, k, v side by side
    o_proj: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    # tensor-parallel slice of the heads (actors/moe/shuffle.py): the local KV head each local query head reads,
    # (nh,); None: grouped-query attention's own grouping, nh / kvh query heads per KV head
    kv_map: torch.Tensor | None = None
    fused: object | None = None  # our CPU kernels (torch.ops.specfleet_<isa>) where they run this layer (fused_ops)
    deterministic: bool = False  # batch-invariant attention (actors/model/deterministic.py)
    # an RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3: their q_norm, k_norm): gains (hd,) each
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    qk_norm_fp32: bool = False  # Gemma's form of those norms (rms_norm's fp32)
    eps: float = 1e-6  # of the q/k norms
    # the score scale over the default hd ** -0.5, applied to q after RoPE (Gemma's query_pre_attn_scalar ** -0.5
    # where it is not hd ** -0.5): every attention kernel then keeps its own hd ** -0.5; None where it is 1
    q_scale: float | None = None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) -> q (N, nh, hd), k and v (N, kvh, hd), RoPE applied to q and k (in one call)."""
        n, nh, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, nh + 2 * kvh, hd)  # (N, nh + 2 kvh, hd)
        qk = qkv[:, :nh + kvh]  # (N, nh + kvh, hd)
        if self.qk_norm is not None:  # per head, before RoPE
            q_gain, k_gain = self.qk_norm
            qk = torch.cat([rms_norm(qk[:, :nh], q_gain, self.eps, self.qk_norm_fp32),
                            rms_norm(qk[:, nh:], k_gain, self.eps, self.qk_norm_fp32)], dim=1)
        if self.fused is not None:
            self.fused.rope_(qk, cos, sin)  # in place, one call
        else:
            qk = apply_rope(qk, cos, sin)
        q = qk[:, :nh] if self.q_scale is None else qk[:, :nh] * self.q_scale
        return q, qk[:, nh:], qkv[:, nh + kvh:]

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
        if self.deterministic:
            from actors.model.deterministic import attend

            return self.o_proj(attend(self, q, k, v, meta, cache, layer))
        if meta.span is not None and self.kv_map is None and self.fused is not None:  # write and attend, one call
            kpool, vpool = cache.pools(layer)
            out = self.fused.span_attention(q, k, v, kpool, vpool, meta.slots, *meta.span, self.sliding_window or 0)
            return self.o_proj(out)
        cache.write(layer, meta.slots, k, v)
        if meta.span is not None and self.kv_map is None:  # one sequence on consecutive blocks: read in place
            return self.o_proj(self._attend_span(q, cache, layer, meta))
        keys, values = cache.gather(layer, meta.block_tables)  # (B, S, kvh, hd) each
        if len(meta.seqs) == 1 and self.kv_map is None and self.fused is not None:
            # one sequence on blocks that are not consecutive (the prefix cache shares its leading ones): the same
            # kernel as in place, over a copy of its S slots, so its output is the same as on consecutive blocks
            n, length = meta.seqs[0]
            slots = torch.arange(length - n, length, device=q.device)  # (T,)
            return self.o_proj(self.fused.span_attention(q, k, v, keys[0, :length], values[0, :length], slots, 0,
                                                         length, self.sliding_window or 0))
        if self.kv_map is not None:
            keys, values = keys[:, :, self.kv_map], values[:, :, self.kv_map]  # (B, S, nh, hd) each
        b, t = meta.padded_shape
        if meta.packed_is_padded:  # every sequence brings T tokens: the packed rows are the padded layout
            q_pad = q
        else:
            q_pad = q.new_zeros(b * t, self.num_heads, self.head_dim)
            q_pad[meta.pad_index] = q
        out = F.scaled_dot_product_attention(
            q_pad.view(b, t, self.num_heads, self.head_dim).transpose(1, 2),  # (B, nh, T, hd)
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask(self.sliding_window),  # (B, 1, T, S)
            enable_gqa=self.kv_map is None and self.num_heads != self.num_kv_heads,
        )  # (B, nh, T, hd)
        out = out.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim)  # (B*T, nh*hd)
        if not meta.packed_is_padded:
            out = out[meta.pad_index]  # (N, nh*hd)
        return self.o_proj(out)

    def _attend_span(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one sequence whose blocks are consecutive in the pool: its keys and values are a slice
        of the layer's storage (no copy of the pool), exactly its S = start + T slots (no padding). q (T, nh, hd)
        -> (T, nh*hd). Two batched matmuls per KV head in fp32 (the query heads of a group as rows): at a few
        new tokens this is several times faster on the CPU than SDPA's flash kernel (docs/benchmarks.md)."""
        start, length = meta.span
        keys, values = cache.span(layer, start, length)  # (S, kvh, hd) each, views
        t, kvh, hd = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kvh
        qh = q.view(t, kvh, g, hd).transpose(0, 1).reshape(kvh, t * g, hd).float()  # (kvh, T*g, hd)
        scores = torch.bmm(qh, keys.permute(1, 2, 0).float()).mul_(hd ** -0.5)  # (kvh, T*g, S)
        mask = meta.span_mask(self.sliding_window)  # (1, 1, T, S) or None
        if mask is not None:
            scores.view(kvh, t, g, length).masked_fill_(~mask[0, 0, :, None, :], float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1).float())  # (kvh, T*g, hd)
        return out.view(kvh, t, g, hd).transpose(0, 1).reshape(t, self.num_heads * hd).to(q.dtype)


@dataclass
class DenseMLP:
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up in one fused projection."""

    gate_up_proj: nn.Module  # (N, H) -> (N, 2I): gate, then up
    down_proj: nn.Module
    act: nn.Module
    fused: object | None = None  # our CPU kernels where they run this MLP (SiLU, bf16: fused_ops)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (N, I) each
        return self.down_proj(self.act(gate) * up)


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
    """Pre-norm decoder layer: x + attn(norm(x)), then h + ffn(norm(h)). Gemma 2 and 3 ("sandwich" norms) also norm
    each half's output before its residual add: x + norm(attn(norm(x))), then h + norm(ffn(norm(h)))."""

    index: int
    input_norm: torch.Tensor  # (H,)
    post_norm: torch.Tensor  # (H,) the norm before the feed-forward
    eps: float
    attn: Attention
    ffn: DenseMLP | MoE
    fused: object | None = None  # our CPU kernels where they run this layer's norms (fused_ops)
    # Gemma's norms after the attention and after the feed-forward (their gains, (H,) each); None: pre-norm only
    sandwich: tuple[torch.Tensor, torch.Tensor] | None = None
    norm_fp32: bool = False  # Gemma's RMSNorm: every gain is its 1 + w in fp32 (rms_norm's fp32)
    rope: int | None = None  # which of the forward's rotary tables it reads (Gemma 3: local, global); None: the one
    # the decode step in one call (layer_cpu.cpp) where every part runs on our kernels: (projections it was made
    # for, their operands); rebuilt when a projection is swapped (a draft's weights, deterministic wrappers)
    _one_call: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        if self.sandwich is not None or self.norm_fp32 or self.rope is not None:
            h = x + self.attention_update(x, cos, sin, meta, cache)
            return h + self.ffn_update(h)
        if meta.span is not None and x.shape[0] <= DENSE_ROWS and self.fused is not None:
            args = self._decode_args()
            if args is not None:  # one sequence on consecutive blocks, every projection on our int4 kernel
                kpool, vpool = cache.pools(self.index)
                return self.fused.decode_layer(x, self.input_norm, self.post_norm, self.eps, *args, cos, sin, kpool,
                                               vpool, meta.slots, *meta.span, self.attn.sliding_window or 0)
        if self.fused is not None:  # the residual add and the second norm in one call
            a = self.attn(self.fused.rms_norm(x, self.input_norm, self.eps), cos, sin, meta, cache, self.index)
            h, normed = self.fused.add_rms_norm(x, a, self.post_norm, self.eps)
            return h + self.ffn(normed)
        h = x + self.attn(rms_norm(x, self.input_norm, self.eps), cos, sin, meta, cache, self.index)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))

    def attention_update(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache) -> torch.Tensor:
        """What the attention half adds to the residual stream x (N, H) -> (N, H), its KV written (EasySpec's
        attention mode runs the halves apart). cos, sin: (N, 1, hd), or (R, N, 1, hd) where the layer picks one."""
        if self.rope is not None:
            cos, sin = cos[self.rope], sin[self.rope]
        a = self.attn(rms_norm(x, self.input_norm, self.eps, self.norm_fp32), cos, sin, meta, cache, self.index)
        return a if self.sandwich is None else rms_norm(a, self.sandwich[0], self.eps, self.norm_fp32)

    def ffn_update(self, h: torch.Tensor) -> torch.Tensor:
        """What the feed-forward half adds to the residual stream h (N, H) -> (N, H)."""
        y = self.ffn(rms_norm(h, self.post_norm, self.eps, self.norm_fp32))
        return y if self.sandwich is None else rms_norm(y, self.sandwich[1], self.eps, self.norm_fp32)

    def _decode_args(self) -> tuple | None:
        """`decode_layer`'s weights for this layer (its projections' operands, widths, input form and heads), or None
        where a part of its decode step does not run on our kernels (then the layer runs op by op)."""
        a, ffn = self.attn, self.ffn
        projs = (a.qkv_proj, a.o_proj, getattr(ffn, "gate_up_proj", None), getattr(ffn, "down_proj", None))
        if self._one_call is not None and all(p is q for p, q in zip(self._one_call[0], projs)):
            return self._one_call[1]
        ours = (a.fused is not None and a.kv_map is None and a.qk_norm is None and a.q_scale is None
                and isinstance(ffn, DenseMLP) and ffn.fused is not None
                and all(isinstance(p, Int4Linear) and p.own is not None for p in projs)
                and len({p.activations for p in projs}) == 1)
        args = None if not ours else (*(p.operands() for p in projs), [p.out_features for p in projs],
                                      projs[0].activations == "int8", [a.num_heads, a.num_kv_heads, a.head_dim])
        self._one_call = (projs, args)
        return args


def fused_ops(layer: DecoderLayer, act: str, device: torch.device, dtype: torch.dtype) -> None:
    """Hand our CPU kernels (actors/model/cpu_kernels.py) to the parts of `layer` they can run: bf16 on a CPU where
    they are built, widths in whole vectors (hidden size and MLP width multiples of 16, head dim of 32), SiLU. The
    layer's own norms (and with them the one-call decode step) only where they are Llama's form (not Gemma's
    sandwich of fp32 norms); the one-call decode step also takes no q/k norms (Qwen3's layers run op by op)."""
    from actors.model import cpu_kernels

    ops = cpu_kernels.ops() if (device.type, dtype) == ("cpu", torch.bfloat16) else None
    a = layer.attn
    if ops is None or layer.input_norm.shape[0] % 16 or a.head_dim % 32 or a.head_dim > 256:
        return
    a.fused = ops
    if layer.sandwich is None and not layer.norm_fp32 and layer.rope is None:
        layer.fused = ops
    if isinstance(layer.ffn, DenseMLP) and act == "silu" and layer.ffn.down_proj.in_features % 16 == 0:
        layer.ffn.fused = ops
