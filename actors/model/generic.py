"""The generic path: any decoder-only transformers model whose attention goes through its attention interface, run
layer by layer on our paged KV cache (the approach of vLLM's Transformers backend: the model's own modules, our
attention).

We register an attention function, "specfleet", and set it on the model: transformers then calls it from every layer
with q and k already normed and rotated and the layer's `scaling`, `sliding_window`, `softcap` and `s_aux` (sinks).
The batch layout (AttentionMetadata and the runner's own cache) travels as one forward keyword, `specfleet_batch`,
which transformers threads through the decoder layer and its attention down to our function: no global state, so a
target and a self-speculative draft share the weights and keep their caches apart. Called without it (transformers'
own forward or `generate`), the function is the model's own eager attention: the reference stays the reference.

Shape legend as in actors/model/layers.py: N new tokens (packed), H hidden size, nh query heads, kvh KV heads,
hd head dim, R rotary tables of a forward (one per distinct layer type that has its own rotary, Gemma 3: 2).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from actors.kv.cache import KVCache
from actors.model.attention import LayerAttention, attend
from actors.model.metadata import AttentionMetadata

ATTENTION = "specfleet"  # the name our attention function is registered under in transformers' interface
BATCH_KWARG = "specfleet_batch"  # the forward keyword that carries a GenericBatch down to it


@dataclass(frozen=True)
class GenericBatch:
    """What our attention function needs from the runner that drives a forward: the batch layout and its cache."""

    meta: AttentionMetadata
    cache: KVCache


def specfleet_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        sliding_window: int | None = None, softcap: float | None = None,
                        s_aux: torch.Tensor | None = None, specfleet_batch: GenericBatch | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (1, nh, N, hd), key and value (1, kvh, N, hd), the packed new
    tokens of our batch as one row -> ((1, N, nh, hd), no weights). Writes k, v into the batch's cache."""
    if specfleet_batch is None:  # transformers' own forward of this model: its own eager attention
        extra = {"softcap": softcap, "sliding_window": sliding_window, "s_aux": s_aux}
        return _eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                              **{k: v for k, v in extra.items() if v is not None}, **kwargs)
    spec = LayerAttention(
        layer=module.layer_idx,
        scaling=scaling if scaling is not None else module.head_dim ** -0.5,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=s_aux,
    )
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # (N, heads, hd) each
    out = attend(q, k, v, spec, specfleet_batch.meta, specfleet_batch.cache)  # (N, nh, hd)
    return out[None], None


def _eager(module: nn.Module) -> Callable:
    """The eager attention of the module's own modeling file (each family's: Gemma 2's softcap, gpt-oss's sinks)."""
    found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if found is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as found
    return found


def register() -> None:
    """Make "specfleet" a valid attention implementation (and its masks, for the reference forward, eager's)."""
    if ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION, specfleet_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


def adopt(hf_model: nn.Module) -> None:
    """Route a loaded model's attention through our function (transformers' set_attn_implementation)."""
    register()
    hf_model.set_attn_implementation(ATTENTION)


class Rotary:
    """The model's rotary embedding, asked once per forward for each layer type that has its own table (Gemma 3's
    local and global layers differ in base): cos and sin (R, N, hd) each, and which table each layer reads."""

    def __init__(self, rotary: nn.Module, layer_types: list[str] | None) -> None:
        self.rotary = rotary
        per_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.kinds: list[str | None] = sorted(set(layer_types)) if per_type and layer_types else [None]
        self.table = {kind: i for i, kind in enumerate(self.kinds)}

    def index(self, layer_type: str | None) -> int:
        """The table a layer of `layer_type` reads."""
        return self.table.get(layer_type, 0)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: any tensor of the forward's dtype and device; positions (N,) -> cos, sin (R, N, hd) each."""
        tables = [self.rotary(x, positions[None]) if kind is None else self.rotary(x, positions[None], kind)
                  for kind in self.kinds]  # each ((1, N, hd), (1, N, hd))
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])


@dataclass
class GenericLayer:
    """One transformers decoder layer run on our batch: (N, H) in, (N, H) out, its K, V written to the cache.

    The runner's layer interface (actors/model/runner.py): `index` is the model's layer id."""

    index: int
    module: nn.Module  # transformers' decoder layer (its weights shared with every runner of the model)
    rope: int  # which of the forward's rotary tables it reads (Rotary.index)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 cache: KVCache) -> torch.Tensor:
        """x (N, H); cos, sin (R, N, hd) -> (N, H)."""
        out = self.module(x[None], **self._inputs(cos, sin, meta, cache))  # the packed batch as one row (1, N, H)
        return _first(out)[0]

    def _inputs(self, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> dict:
        """The keywords transformers' decoder layer and attention take: our attention reads the layout from the
        batch, so there is no mask and no transformers cache."""
        return {"attention_mask": None, "position_embeddings": (cos[self.rope][None], sin[self.rope][None]),
                "position_ids": meta.positions[None], "past_key_values": None,
                BATCH_KWARG: GenericBatch(meta, cache)}  # position_embeddings: (1, N, hd) each

    # ---- the two halves of the layer, for EasySpec's attention mode (actors/speculation/easyspec.py) -------------
    def attention_update(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                         cache: KVCache) -> torch.Tensor:
        """What the layer's attention half adds to the residual stream x (N, H) -> (N, H), its KV written."""
        m, norms = self.module, self.halves()
        h = x[None] if norms.pre_attn is None else norms.pre_attn(x[None])  # (1, N, H)
        a = _first(m.self_attn(hidden_states=h, **self._inputs(cos, sin, meta, cache)))
        a = a if norms.post_attn is None else norms.post_attn(a)
        return (a * norms.residual)[0]

    def ffn_update(self, h: torch.Tensor) -> torch.Tensor:
        """What the layer's feed-forward half adds to the residual stream h (N, H) -> (N, H)."""
        norms = self.halves()
        y = _first(self.module.mlp(norms.pre_ffn(h[None]) if norms.pre_ffn is not None else h[None]))
        y = y if norms.post_ffn is None else norms.post_ffn(y)
        return (y * norms.residual)[0]

    def halves(self) -> "Halves":
        """The norms around each half, by the layer's own module names (the three layouts transformers' decoder
        layers use); ValueError for a layer of another layout (Phi's parallel attention and MLP, Cohere's)."""
        m = self.module
        names = {n for n, _ in m.named_children()}
        residual = float(getattr(m, "residual_multiplier", 1.0))  # Granite scales both updates
        if {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"} <= names:  # Gemma 2 and 3: a norm before and after each half
            return Halves(m.input_layernorm, m.post_attention_layernorm, m.pre_feedforward_layernorm,
                          m.post_feedforward_layernorm, residual)
        if {"post_attention_layernorm", "post_feedforward_layernorm"} <= names and "input_layernorm" not in names:
            return Halves(None, m.post_attention_layernorm, None, m.post_feedforward_layernorm, residual)  # OLMo 2
        if {"input_layernorm", "post_attention_layernorm"} <= names and not names & {"pre_feedforward_layernorm",
                                                                                        "post_feedforward_layernorm"}:
            return Halves(m.input_layernorm, None, m.post_attention_layernorm, None, residual)  # Llama's pre-norm
        raise ValueError(f"EasySpec (speculation.draft_parallel) runs a layer's attention and feed-forward halves "
                         f"apart, and the {type(m).__name__} layout does not split into them here")


@dataclass(frozen=True)
class Halves:
    """The norms before and after a decoder layer's attention and feed-forward halves (None: none there) and the
    factor on each half's residual update."""

    pre_attn: nn.Module | None
    post_attn: nn.Module | None
    pre_ffn: nn.Module | None
    post_ffn: nn.Module | None
    residual: float


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    """A module's main output: transformers' layers return (output, extras) where they have extras (attention
    weights, router logits)."""
    return out[0] if isinstance(out, tuple) else out


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The head's last step as the model's config asks: Granite divides by `logits_scaling`, Cohere multiplies by
    `logit_scale`, Gemma 2 and 3 cap with `final_logit_softcapping` (c * tanh(x / c)). logits (M, V) -> (M, V)."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        logits = logits / scaling
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def embedding_scale(config) -> float | None:
    """The factor on the token embeddings the model's forward applies outside its embedding module (Granite's
    `embedding_multiplier`; Gemma's sqrt(H) is inside its scaled embedding module)."""
    scale = getattr(config, "embedding_multiplier", None)
    return float(scale) if scale not in (None, 1, 1.0) else None
