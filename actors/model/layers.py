"""Decoder-layer maths the project runs itself: RMSNorm, RoPE attention over the paged cache, MLP, MoE.

Weights come from the transformers model (shared, never copied); the computation is ours so that
layer ranges, layer-parallel drafting and expert parallelism can wrap it. Shape legend:
N new tokens of the batch (packed), B sequences, T new tokens per sequence (padded, attention only),
S cached slots per sequence (padded), H hidden size, nh query heads, kvh KV heads, hd head dim,
E experts, I expert width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv.cache import KVCache
from actors.model.attention_backends import AttentionBackend, FusedCpuAttention, Heads, PaddedSdpa, SpanAttention
from actors.model.deterministic import DeterministicAttention
from actors.model.metadata import AttentionMetadata
from actors.model.qlinear import DENSE_ROWS, CpuInt4Linear


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


def attention_backend(heads: Heads, fused: object | None, deterministic: bool) -> AttentionBackend:
    """The attention backend of a layer (actors/model/attention_backends.py), chosen once when the layer is built:
    the batch-invariant one in deterministic mode; torch's SDPA for a tensor-parallel slice of the heads (our kernels
    and the in-place span take grouped-query heads only); our fused CPU kernel where it runs the layer (`fused`,
    see fused_ops); else torch's ops, reading one sequence's keys in place."""
    if deterministic:
        return DeterministicAttention(heads, fused)
    if heads.kv_map is not None:
        return PaddedSdpa(heads)
    if fused is not None:
        return FusedCpuAttention(heads, fused)
    return SpanAttention(heads)


@dataclass(frozen=True)
class Attention:
    """Self-attention of one layer: a fused q/k/v projection (biases as the checkpoint has them) and o_proj, its
    attention backend chosen at construction (`attention_backend`); frozen, so a change is a new layer
    (dataclasses.replace), whose backend is chosen again."""

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
    backend: AttentionBackend = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        heads = Heads(self.num_heads, self.num_kv_heads, self.head_dim, self.sliding_window, self.kv_map)
        object.__setattr__(self, "backend", attention_backend(heads, self.fused, self.deterministic))

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) -> q (N, nh, hd), k and v (N, kvh, hd), RoPE applied to q and k (in one call)."""
        n, nh, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, nh + 2 * kvh, hd)  # (N, nh + 2 kvh, hd)
        qk = qkv[:, :nh + kvh]  # (N, nh + kvh, hd)
        if self.fused is not None and self.qk_norm is not None:  # per head, then RoPE: in place, one call
            self.fused.norm_rope_(qk, *self.qk_norm, nh, self.eps, cos, sin)
        elif self.fused is not None:
            self.fused.rope_(qk, cos, sin)  # in place, one call
        else:
            if self.qk_norm is not None:  # per head, before RoPE
                q_gain, k_gain = self.qk_norm
                qk = torch.cat([rms_norm(qk[:, :nh], q_gain, self.eps, self.qk_norm_fp32),
                                rms_norm(qk[:, nh:], k_gain, self.eps, self.qk_norm_fp32)], dim=1)
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
        q, k, v = self.qkv(x, cos, sin)  # (N, nh, hd), (N, kvh, hd) each
        return self.o_proj(self.backend.write_and_attend(q, k, v, meta, cache, layer))  # (N, nh*hd) -> (N, H)


@dataclass(frozen=True)
class DenseMLP:
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up in one fused projection. Frozen: a change is a new MLP
    (dataclasses.replace)."""

    gate_up_proj: nn.Module  # (N, H) -> (N, 2I): gate, then up
    down_proj: nn.Module
    act: nn.Module
    fused: object | None = None  # our CPU kernels where they run this MLP (SiLU or GELU's tanh form, bf16: fused_ops)
    gelu: bool = False  # the activation is GELU's tanh form (Gemma's GeGLU), not SiLU: which gated product they run

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:  # act(gate) * up in one call
            gated = self.fused.gelu_tanh_mul if self.gelu else self.fused.silu_mul
            return self.down_proj(gated(self.gate_up_proj(x)))
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
    each half's output before its residual add: x + norm(attn(norm(x))), then h + norm(ffn(norm(h))).

    Its path is chosen once, at construction, from its parts: the norms on our CPU kernels (`_on_kernels`, Llama's
    and Gemma's alike, with the one-call decode step where every part runs on them); else torch's ops, Gemma's norms
    and RoPE tables by layer type (`_halves`) or Llama's (`_op_by_op`). A
    layer whose attention or dense MLP changes is built again (dataclasses.replace), which chooses again; the
    feed-forward of a MoE layer may be swapped in place (expert parallelism, routing profiles): no path depends
    on it."""

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
    # the weights of the decode step in one call (layer_cpu.cpp) where every part runs on our kernels, else None
    _one_call: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _path: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fused is not None:
            self._one_call = self._decode_args()
            self._path = self._on_kernels
        elif self.sandwich is not None or self.norm_fp32 or self.rope is not None:
            self._path = self._halves
        else:
            self._path = self._op_by_op

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        """x (N, H) -> (N, H); writes the layer's K, V of the new tokens. cos, sin: (N, 1, hd), or (R, N, 1, hd)
        where the layer picks one of R tables (`rope`)."""
        return self._path(x, cos, sin, meta, cache)

    def _halves(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache) -> torch.Tensor:
        h = x + self.attention_update(x, cos, sin, meta, cache)
        return h + self.ffn_update(h)

    def _on_kernels(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                    cache: KVCache) -> torch.Tensor:
        """On our CPU kernels. Per call: a step of one sequence on consecutive blocks and at most DENSE_ROWS rows (a
        decode, a verification; known only from the step's tokens and block tables) is one `decode_layer` call
        where the layer has its weights (`_one_call`); anything else runs op by op, the residual add and the second
        norm in one call. The kernels take each norm in the form of its gain's dtype (bf16 Llama's, fp32 Gemma's)."""
        if self.rope is not None:
            cos, sin = cos[self.rope], sin[self.rope]
        if self._one_call is not None and meta.span is not None and x.shape[0] <= DENSE_ROWS:
            kpool, vpool = cache.pools(self.index)
            return self.fused.decode_layer(x, self._one_call[0], self.eps, *self._one_call[1:], cos, sin, kpool,
                                           vpool, meta.slots, *meta.span, self.attn.sliding_window or 0)
        a = self.attn(self.fused.rms_norm(x, self.input_norm, self.eps), cos, sin, meta, cache, self.index)
        if self.sandwich is not None:
            a = self.fused.rms_norm(a, self.sandwich[0], self.eps)
        h, normed = self.fused.add_rms_norm(x, a, self.post_norm, self.eps)
        y = self.ffn(normed)
        return h + (y if self.sandwich is None else self.fused.rms_norm(y, self.sandwich[1], self.eps))

    def _op_by_op(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                  cache: KVCache) -> torch.Tensor:
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
        """`decode_layer`'s weights for this layer (its norms' gains, its projections' operands, widths, input form,
        heads, q/k norms, query scale and activation: the op's arguments but x and eps, then those after the
        projections), or None where a part of its decode step does not run on our kernels (then the layer runs op
        by op)."""
        a, ffn = self.attn, self.ffn
        projs = (a.qkv_proj, a.o_proj, getattr(ffn, "gate_up_proj", None), getattr(ffn, "down_proj", None))
        ours = (a.fused is not None and a.kv_map is None and isinstance(ffn, DenseMLP) and ffn.fused is not None
                and all(isinstance(p, CpuInt4Linear) for p in projs)
                and len({p.activations for p in projs}) == 1)
        if not ours:
            return None
        norms = [self.input_norm, self.post_norm, *(self.sandwich or ())]  # the op's order: before, then after
        return (norms, *(p.operands() for p in projs), [p.out_features for p in projs],
                projs[0].activations == "int8", [a.num_heads, a.num_kv_heads, a.head_dim], list(a.qk_norm or ()),
                1.0 if a.q_scale is None else a.q_scale, ffn.gelu)


# the activations our gated-product kernels compute: SiLU (SwiGLU), GELU's tanh form (GeGLU; all three names are
# 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in transformers' activations)
KERNEL_ACTS = {"silu": False, "swish": False, "gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True}


def fused_ops(layer: DecoderLayer, act: str, device: torch.device, dtype: torch.dtype) -> DecoderLayer:
    """`layer` with our CPU kernels (actors/model/cpu_kernels.py) handed to the parts they can run (a new layer,
    whose paths are chosen for them; `layer` itself where they run none): bf16 on a CPU where they are built, widths
    in whole vectors (hidden size and MLP width multiples of 16, head dim of 32), SiLU or GELU's tanh form
    (`KERNEL_ACTS`). The layer's norms run on them, and with them the one-call decode step, where every gain is in
    the form its dtype tells the kernels (bf16: Llama's and Qwen's norms; fp32: Gemma's 1 + w, and its norms after
    each half): Llama, Qwen2, Qwen3 and Gemma 3 layers alike."""
    from actors.model import cpu_kernels

    ops = cpu_kernels.ops() if (device.type, dtype) == ("cpu", torch.bfloat16) else None
    a = layer.attn
    if ops is None or layer.input_norm.shape[0] % 16 or a.head_dim % 32 or a.head_dim > 256:
        return layer
    gains = [layer.input_norm, layer.post_norm, *(layer.sandwich or ())]
    norms = all(g.dtype == (torch.float32 if layer.norm_fp32 else dtype) for g in gains)
    qk_form = torch.float32 if a.qk_norm_fp32 else dtype
    attn = replace(a, fused=ops) if all(g.dtype == qk_form for g in a.qk_norm or ()) else a
    ffn = layer.ffn
    if isinstance(ffn, DenseMLP) and act in KERNEL_ACTS and ffn.down_proj.in_features % 16 == 0:
        ffn = replace(ffn, fused=ops, gelu=KERNEL_ACTS[act])
    return replace(layer, attn=attn, ffn=ffn, fused=ops if norms else layer.fused)
