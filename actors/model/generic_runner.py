"""GenericRunner: the ModelRunner of the generic path (actors/model/generic.py), transformers' decoder layers on our
paged cache.

The same runner as the native one to everything that drives it (engine, pipeline stages, self-speculative drafts,
EasySpec groups, migration): a chosen set of layer ids, the first stage embeds, the last makes logits, its own KV
cache; only the layers, the prologue (embeddings and the model's multiplier, the rotary tables per layer type) and
the epilogue (final norm, head on the rows asked for, the config's logit scaling or softcap) are the model's own.
Linear maps are the checkpoint's dense weights (a GGUF file's as transformers' loader dequantized them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.kv.cache import KVCache
from actors.model.backends import FINAL_NORMS
from actors.model.generic import GenericLayer, Rotary, embedding_scale, final_logits
from actors.model.metadata import AttentionMetadata
from actors.model.runner import ModelRunner
from actors.model.weights import WeightMode
from cluster.config import CacheConfig

DENSE_MODES = ("stored", "dequantized")  # the generic path computes on the weights as transformers holds them


class GenericRunner(ModelRunner):
    """Runs `layer_ids` of a generic-path model in order; embeds tokens if `first`, returns logits if `last`.
    `ModelRunner(model, ...)` of a model loaded on the generic path builds one."""

    def _build(self, layer_ids: Sequence[int], cache: CacheConfig, deterministic: bool) -> None:
        """The generic path's layers, ends, rotary tables and KV cache (`ModelRunner.__init__` set the rest)."""
        if deterministic:
            raise ValueError("deterministic mode runs on the native path only (engine.model.backend: native)")
        model, first, last, cfg = self.model, self.first, self.last, self.model.config
        self._dense_only(self.weights)
        self.deterministic = False
        hf = model.hf_model
        base = hf.model
        final_norm = next((getattr(base, n) for n in FINAL_NORMS if getattr(base, n, None) is not None), None)
        if self.device != model.device:  # move only what this runner runs (a shared checkpoint keeps the rest)
            ends = ([base.embed_tokens] if first else []) + ([final_norm, hf.lm_head] if last else [])
            for module in [base.layers[i] for i in layer_ids] + [base.rotary_emb] + ends:
                module.to(self.device)
        layer_types = getattr(cfg, "layer_types", None)
        self.rotary = Rotary(base.rotary_emb, layer_types)
        self.layers = [GenericLayer(i, base.layers[i], self.rotary.index(layer_types[i] if layer_types else None))
                       for i in layer_ids]
        self.embed = base.embed_tokens if first else None
        self.embed_scale = embedding_scale(cfg)
        self.final_norm = final_norm if last else None
        self.lm_head = hf.lm_head if last else None
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = KVCache(list(layer_ids), cache.num_blocks, cache.block_size, cfg.num_key_value_heads, head_dim,
                             model.dtype, device=self.device)

    @staticmethod
    def _dense_only(weights: WeightMode) -> None:
        if weights not in DENSE_MODES:
            raise ValueError(f"weights {weights!r}: the generic path computes on the checkpoint's dense weights "
                             f"({' or '.join(DENSE_MODES)}); quantized linear maps are on the native path")

    def use_weights(self, weights: WeightMode) -> None:
        """The ModelRunner interface: only the dense modes exist here (a draft quantized at load is refused)."""
        self._dense_only(weights)
        self.weights = weights

    def rotary_tables(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables cos, sin (R, N, hd) of the batch's positions (each layer reads its type's)."""
        probe = torch.empty(0, dtype=self.model.dtype, device=self.device)  # the tables' dtype and device
        return self.rotary(probe, meta.positions)  # (R, N, hd) each

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden (N, H) of token ids (N,), times the model's embedding multiplier where it has one."""
        x = self.embed(token_ids)  # (N, H)
        return x * self.embed_scale if self.embed_scale is not None else x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (M, V) fp32 of hidden rows h (M, H): the model's final norm and head, its scaling or softcap."""
        return final_logits(self.model.config, self.lm_head(self.final_norm(h)).float())  # (M, V)

