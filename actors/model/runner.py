"""ModelRunner: runs a chosen set of a model's decoder layers over the runner's own paged KV cache.

A runner is a pipeline stage (a contiguous layer range; the first embeds tokens, the last produces
logits), a whole model (all layers, first and last), or a self-speculative draft (a subset of the
target's layers, sharing its weights, with a cache of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch
from transformers.activations import ACT2FN

from actors.kv.cache import KVCache, KVExport, reshard
from actors.model.backends import NATIVE_ARCHITECTURES
from actors.model.deterministic import row_invariant
from actors.model.generic import final_logits
from actors.model.layers import Attention, DecoderLayer, DenseMLP, MoE, RopeTable, fused_ops, gemma_gain, rms_norm
from actors.model.loader import LoadedModel
from actors.model.metadata import AttentionMetadata, SeqChunk
from actors.model.qlinear import Activations
from actors.model.weights import Part, WeightMode, fuse, head_projection, layer_projections
from cluster.config import CacheConfig


class LayerPass(Protocol):
    """A pass over the layers applied to a runner from outside, as gpt-fast's tp.py applies tensor parallelism:
    EasySpec's parallel groups (actors/speculation/easyspec.py's `enable` sets `runner.layer_parallel`); the model
    never imports it."""

    def run(self, layers: Sequence[DecoderLayer], x: torch.Tensor, parallel: bool, cos: torch.Tensor,
            sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x (N, H) through every layer (groups at once if `parallel`); returns (N, H)."""
        ...


class CacheFull(RuntimeError):
    """A forward needs KV blocks that are not free; the engine should have reserved them first."""


def _sliding_window(config, index: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[index] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def build_layer(model: LoadedModel, index: int, device: torch.device, weights: WeightMode,
                activations: Activations | None = None) -> DecoderLayer:
    """Wrap layer `index` of the transformers model in our own layer, its projections fused and in `weights`
    mode on `device` (actors/model/weights.py; shared with every runner of the model, never copied twice)."""
    cfg = model.config
    hf = model.hf_model.model.layers[index]
    proj = layer_projections(model, index, device, weights, activations or model.activations)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gemma = gemma_norms(cfg)
    gain = gemma_gain if gemma else (lambda w: w)
    sa = hf.self_attn
    qk_norm = (gain(sa.q_norm.weight), gain(sa.k_norm.weight)) if hasattr(sa, "q_norm") else None
    scalar = getattr(cfg, "query_pre_attn_scalar", None)  # Gemma scales scores by its ** -0.5, not hd ** -0.5
    q_scale = None if scalar is None or scalar == head_dim else (head_dim / scalar) ** 0.5
    attn = Attention(
        proj.qkv, proj.o,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        sliding_window=_sliding_window(cfg, index),
        qk_norm=qk_norm,
        qk_norm_fp32=gemma,
        eps=cfg.rms_norm_eps,
        q_scale=q_scale,
    )
    mlp = hf.mlp
    ffn: DenseMLP | MoE
    if hasattr(mlp, "experts"):
        shared = getattr(mlp, "shared_expert", None)
        ffn = MoE(
            router=mlp.gate.weight,
            gate_up=mlp.experts.gate_up_proj,
            down=mlp.experts.down_proj,
            top_k=cfg.num_experts_per_tok,
            normalize_top_k=getattr(cfg, "norm_topk_prob", True),
            act=ACT2FN[cfg.hidden_act],
            weights_in_input_dtype=cfg.model_type in ("qwen2_moe", "qwen3_moe"),
            shared=shared_expert_mlp(model, index, device) if shared is not None else None,
            shared_gate=getattr(mlp, "shared_expert_gate", None),
        )
    else:
        ffn = DenseMLP(proj.gate_up, proj.down, mlp.act_fn)
    if gemma:  # a norm before and after each half, 1 + w in fp32; RoPE tables by layer type (local, global)
        layer = DecoderLayer(index=index, input_norm=gain(hf.input_layernorm.weight),
                             post_norm=gain(hf.pre_feedforward_layernorm.weight), eps=cfg.rms_norm_eps, attn=attn,
                             ffn=ffn, sandwich=(gain(hf.post_attention_layernorm.weight),
                                                gain(hf.post_feedforward_layernorm.weight)),
                             norm_fp32=True, rope=rope_kinds(model).index(cfg.layer_types[index]))
    else:
        layer = DecoderLayer(index=index, input_norm=hf.input_layernorm.weight,
                             post_norm=hf.post_attention_layernorm.weight, eps=cfg.rms_norm_eps, attn=attn, ffn=ffn)
    return fused_ops(layer, activation(cfg), device, model.dtype)


def activation(config) -> str:
    """The MLP's activation by name (Gemma's config calls it hidden_activation)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def gemma_norms(config) -> bool:
    """Whether the model's norms are Gemma's (1 + w in fp32, a norm before and after each half of a layer)."""
    return config.model_type == "gemma3_text"


def rope_kinds(model: LoadedModel) -> list[str | None]:
    """The rotary tables a forward computes: one per layer type where the model's rotary embedding takes the layer
    type (Gemma 3: a local base for sliding layers, a global base with its scaling for full ones), else one."""
    rotary = model.hf_model.model.rotary_emb
    types = getattr(rotary, "layer_types", None)
    return list(types) if types else [None]


def shared_expert_mlp(model: LoadedModel, index: int, device: torch.device) -> DenseMLP:
    """A MoE layer's shared expert as a dense MLP with a fused gate-up projection (experts stay dense)."""
    shared = model.hf_model.model.layers[index].mlp.shared_expert
    prefix = f"model.layers.{index}.mlp.shared_expert."
    gate_up = fuse([Part(prefix + "gate_proj", shared.gate_proj), Part(prefix + "up_proj", shared.up_proj)],
                   device, model.dtype, "dequantized", lambda name: None)
    return DenseMLP(gate_up, shared.down_proj, shared.act_fn)


def _dense_part(layer: torch.nn.Module, weights: WeightMode) -> torch.nn.Module:
    """What of a transformers decoder layer a runner on another device moves there: all of it for dense weights;
    with quantized ones, its norms and MoE feed-forward (the projections are built on the device from the source)."""
    if weights == "dequantized":
        return layer
    keep = [m for name, m in layer.named_modules() if name.endswith("norm")] + (  # Gemma's four, q/k norms
        [layer.mlp] if hasattr(layer.mlp, "experts") else [])
    return torch.nn.ModuleList(keep)


def check_layers(layer_ids: Sequence[int], num_layers: int) -> None:
    """A runner's layer ids: at least one, each one of the model's `num_layers`; ValueError naming them otherwise."""
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"layers {list(layer_ids)} not within the model's {num_layers} layers")


class ModelRunner:
    """Runs `layer_ids` of a loaded model in order; embeds tokens if `first`, returns logits if `last`.

    `weights` and `activations` (default: the model's) are how its linear maps compute (actors/model/weights.py,
    qlinear.py). `deterministic`:
    the batch-invariant forward (actors/model/deterministic.py): a token's logits do not depend on its batch.
    """

    exports_kv = True  # the PipelineRunner interface: its KV can be exported and imported
    replicated_cache = True  # one cache: block sharing works

    def __new__(cls, model: LoadedModel, *args, **kwargs) -> "ModelRunner":
        """A model loaded on the generic path (actors/model/backends.py) gets the generic runner: every caller
        builds runners the same way whichever path the model runs on."""
        if cls is ModelRunner and model.backend == "generic":
            from actors.model.generic_runner import GenericRunner

            cls = GenericRunner
        return super().__new__(cls)

    def __init__(
        self,
        model: LoadedModel,
        layer_ids: Sequence[int],
        cache: CacheConfig,
        first: bool = True,
        last: bool = True,
        device: torch.device | str | None = None,
        weights: WeightMode | None = None,
        deterministic: bool = False,
        activations: Activations | None = None,
    ) -> None:
        check_layers(layer_ids, model.config.num_hidden_layers)
        self.model = model
        # weights of this runner, its KV cache and every tensor of a forward live here (default: the weights')
        self.device = torch.device(device) if device is not None else model.device
        self.first, self.last = first, last
        self.weights: WeightMode = weights or model.weights
        self.activations: Activations = activations or model.activations
        self.layer_parallel: LayerPass | None = None  # EasySpec groups of a draft (actors/speculation/easyspec.py)
        self._build(layer_ids, cache, deterministic)

    def _build(self, layer_ids: Sequence[int], cache: CacheConfig, deterministic: bool) -> None:
        """The native path's layers, ends, rotary tables and KV cache (the generic runner builds its own)."""
        model, first, last = self.model, self.first, self.last
        cfg = model.config
        assert cfg.model_type in NATIVE_ARCHITECTURES, cfg.model_type
        hf = model.hf_model
        if self.device != model.device:  # move only what this runner runs (a shared checkpoint keeps the rest)
            for module in [_dense_part(hf.model.layers[i], self.weights) for i in layer_ids] + [hf.model.rotary_emb] \
                    + ([hf.model.embed_tokens] if first else []) + ([hf.model.norm] if last else []):
                module.to(self.device)
        self.layers = [build_layer(model, i, self.device, self.weights, self.activations) for i in layer_ids]
        self.embed = hf.model.embed_tokens if first else None  # (Gemma's scales by sqrt(H) itself)
        self.gemma = gemma_norms(cfg)
        self.norm = (gemma_gain(hf.model.norm.weight) if self.gemma else hf.model.norm.weight) if last else None
        self.lm_head = head_projection(model, self.device, self.weights, self.activations) if last else None
        if model.stored is not None:  # what was packed for our kernels, kept for the next start
            model.stored.layout.flush()
        self.deterministic = deterministic
        self._invariant()
        self.ropes = [RopeTable(hf.model.rotary_emb, model.dtype, self.device, kind) for kind in rope_kinds(model)]
        attn = self.layers[0].attn
        self.cache = KVCache(
            list(layer_ids), cache.num_blocks, cache.block_size, attn.num_kv_heads, attn.head_dim, model.dtype,
            device=self.device,
        )

    def use_weights(self, weights: WeightMode) -> None:
        """Compute this runner's linear maps in `weights` mode from now on (a draft quantized after loading)."""
        self.weights = weights
        for pos, layer in enumerate(self.layers):  # new layers around the new projections: their paths chosen again
            proj = layer_projections(self.model, layer.index, self.device, weights, self.activations)
            ffn = replace(layer.ffn, gate_up_proj=proj.gate_up, down_proj=proj.down) \
                if isinstance(layer.ffn, DenseMLP) else layer.ffn
            self.layers[pos] = replace(layer, attn=replace(layer.attn, qkv_proj=proj.qkv, o_proj=proj.o), ffn=ffn)
        if self.last:
            self.lm_head = head_projection(self.model, self.device, weights, self.activations)
        self._invariant()

    def _invariant(self) -> None:
        """In deterministic mode, make this runner's linear maps and attention batch-invariant (wrappers: the
        shared projections themselves are not changed)."""
        if not self.deterministic:
            return
        for pos, layer in enumerate(self.layers):
            if isinstance(layer.ffn, MoE):
                raise ValueError("deterministic mode does not cover mixture-of-experts layers (docs/determinism.md)")
            a, ffn = layer.attn, layer.ffn
            attn = replace(a, deterministic=True, qkv_proj=row_invariant(a.qkv_proj), o_proj=row_invariant(a.o_proj))
            ffn = replace(ffn, gate_up_proj=row_invariant(ffn.gate_up_proj), down_proj=row_invariant(ffn.down_proj))
            self.layers[pos] = replace(layer, attn=attn, ffn=ffn)  # its paths chosen again: batch-invariant attention
        if self.lm_head is not None:
            self.lm_head = row_invariant(self.lm_head)

    @property
    def layer_ids(self) -> list[int]:
        return [layer.index for layer in self.layers]

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        """Make room in this runner's cache for `total_tokens` tokens of a request."""
        return self.cache.reserve(request_id, total_tokens)

    def export_kv(self, request_id: str, start: int = 0, end: int | None = None, links: None = None) -> list[KVExport]:
        """KV of tokens [start, end) of a request (the PipelineRunner interface: one export per stage; a bare runner
        has no stages of its own to send it over a migration's links)."""
        if links is not None:
            raise ValueError("a bare ModelRunner cannot send KV over links: drive it through a PipelineRunner")
        return [self.cache.export(request_id, start, end)]

    def import_kv(self, exports: Sequence[KVExport]) -> bool:
        """Append exported KV (of any split of this model's layers) after the request's KV; False if no room."""
        return self.cache.import_(reshard(exports, [self.layer_ids])[0])

    def expert_stats(self) -> None:
        """The PipelineRunner interface: a runner in this process has no expert-parallel ranks to count."""
        return None

    def begin(self, chunks: list[SeqChunk]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Open a forward over `chunks` (`forward`'s, or an EasySpec member's part of one:
        actors/speculation/draft_group.py): room in the cache for their new tokens, the batch's attention metadata and
        rotary cos, sin (N, 1, hd)."""
        for c in chunks:
            if not self.cache.reserve(c.request_id, self.cache.length(c.request_id) + len(c.token_ids)):
                raise CacheFull(f"no KV blocks for {c.request_id}")
        meta = AttentionMetadata.build(chunks, self.cache)
        cos, sin = self.rotary_tables(meta)
        return meta, cos, sin

    def rotary_tables(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos, sin (N, 1, hd) of the batch's positions; (R, N, 1, hd) with a table per layer type."""
        if self.ropes[0].layer_type is None:
            return self.ropes[0](meta)  # (N, 1, hd) each
        tables = [rope(meta) for rope in self.ropes]  # each layer picks its type's (DecoderLayer.rope)
        return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])  # (R, N, 1, hd)

    def end(self, chunks: list[SeqChunk]) -> None:
        """Close a forward: the chunks' new tokens, whose KV the layers wrote, now count in the cache's lengths."""
        for c in chunks:
            self.cache.set_length(c.request_id, self.cache.length(c.request_id) + len(c.token_ids))

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], hidden: torch.Tensor | None = None,
                parallel: bool = False) -> torch.Tensor:
        """Run the new tokens of each chunk through this runner's layers, appending their KV.

        `parallel`: run the layer-parallel groups of `self.layer_parallel` (EasySpec), if it has any; otherwise
        (and by default) every layer in true order.

        First runner: `hidden` is None and tokens are embedded. Others: hidden (N, H) from the previous
        stage, tokens packed in chunk order, on this runner's device. Returns logits (sum num_logits, V) in fp32
        if last, else hidden (N, H), on this runner's device.
        """
        meta, cos, sin = self.begin(chunks)
        x = self.embed_tokens(meta.token_ids) if self.first else hidden  # (N, H)
        if self.layer_parallel is not None:
            x = self.layer_parallel.run(self.layers, x, parallel, cos, sin, meta, self.cache)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, meta, self.cache)
        self.end(chunks)
        if not self.last:
            return x
        h = x[meta.logits_index]  # (sum num_logits, H)
        if h.shape[0] == 0:  # prefill chunks only: no logits wanted
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return self.logits(h)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The first runner's prologue: hidden (N, H) of token ids (N,) (Gemma's embedding scales by sqrt(H) itself)."""
        return self.embed(token_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last runner's epilogue: logits (M, V) fp32 of hidden rows h (M, H), through the final norm and head."""
        fused = self.layers[-1].fused  # our CPU kernels, where they run this model's norms
        eps = self.model.config.rms_norm_eps
        normed = fused.rms_norm(h, self.norm, eps) if fused is not None else rms_norm(h, self.norm, eps, self.gemma)
        return final_logits(self.model.config, self.lm_head(normed).float())  # (M, V)
