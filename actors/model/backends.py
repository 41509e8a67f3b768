"""Which path runs a model: the hand-written layers (native) or transformers' own decoder layers on our cache
(generic), chosen from the config alone, before any weight is read.

`engine.model.backend`: `auto` takes the native path for the families written by hand and the generic one for every
other decoder-only model transformers ships whose attention goes through its attention interface (the way vLLM's
Transformers backend takes models it has no implementation of); `native` and `generic` force one. A model neither
path can run is refused with the reason, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PretrainedConfig

Backend = Literal["native", "generic"]
BackendChoice = Literal["auto", "native", "generic"]
BACKEND_CHOICES: tuple[BackendChoice, ...] = ("auto", "native", "generic")

# model_type -> feed-forward kind of the hand-written layers (actors/model/layers.py): Qwen3 is Qwen2 with a q/k
# RMSNorm per head; Gemma 3 adds sandwich norms (1 + w), GeGLU, sqrt(H) embeddings and local/global RoPE
NATIVE_ARCHITECTURES = {"llama": "dense", "qwen2": "dense", "mistral": "dense", "mixtral": "moe", "qwen2_moe": "moe",
                        "qwen3": "dense", "qwen3_moe": "moe", "gemma3_text": "dense"}
# where a base model keeps its final norm (Phi calls it final_layernorm)
FINAL_NORMS = ("norm", "final_layernorm")
# the layer types the generic path's attention covers (transformers' `config.layer_types` vocabulary)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class Unsupported(ValueError):
    """No path runs this model; the message is the one-line reason."""


@dataclass(frozen=True)
class BackendPlan:
    """The path a model runs on and why, as the load log line and `specfleet generate` say it."""

    backend: Backend
    reason: str

    def describe(self) -> str:
        return f"{self.backend} path ({self.reason})"


def choose_backend(config: PretrainedConfig, requested: BackendChoice = "auto") -> BackendPlan:
    """The path for a model of `config` under `requested`; raises Unsupported with the reason if none runs it."""
    kind = config.model_type
    if requested not in BACKEND_CHOICES:
        raise Unsupported(f"unknown backend {requested!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    refusal = native_refusal(config)
    if requested == "native":
        if refusal is not None:
            raise Unsupported(f"{kind!r} has no native path ({refusal}); use backend: generic or auto")
        return BackendPlan("native", "forced by engine.model.backend")
    if requested == "auto" and refusal is None:
        return BackendPlan("native", f"hand-written layers for {kind}")
    generic_refusal(config)
    why = "forced by engine.model.backend" if requested == "generic" else refusal
    return BackendPlan("generic", f"transformers' {kind} decoder layers on our paged cache, {why}")


def native_refusal(config: PretrainedConfig) -> str | None:
    """Why the hand-written layers cannot run a model of `config` (None where they can): a family not written by
    hand, or a setting of a written family they do not implement."""
    kind = config.model_type
    if kind not in NATIVE_ARCHITECTURES:
        return f"no hand-written layers for {kind}"
    if getattr(config, "attn_logit_softcapping", None):
        return "attn_logit_softcapping set, which the hand-written layers do not apply"
    other = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES)
    if other:
        return f"layer types {', '.join(other)}, which the hand-written layers do not run"
    return None


def generic_refusal(config: PretrainedConfig) -> None:
    """Raise Unsupported naming why the generic path cannot run a model of `config` (nothing if it can).

    Checked on the config and on the model built on the meta device (no memory, no weights): a decoder-only causal
    LM; attention through transformers' attention interface; K and V cached per head (not MLA's latent); only full
    or sliding attention layers (no linear-attention, recurrent or convolution layers); one decoder ModuleList
    `model.layers` whose layers own a `self_attn`; a shared rotary embedding; a final norm and an LM head."""
    from transformers import AutoModelForCausalLM

    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise Unsupported(f"{kind!r} is an encoder-decoder model; the generic path runs decoder-only models")
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:
        raise Unsupported(f"{kind!r} has no causal-LM class in transformers; the generic path runs decoder-only LMs")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise Unsupported(f"{kind!r} uses multi-head latent attention (MLA), whose cache is a latent, not per-head K/V")
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - ATTENTION_LAYER_TYPES)
    if other:
        raise Unsupported(f"{kind!r} is a hybrid model (layer types {', '.join(other)}); the generic path runs full "
                          "and sliding attention layers only")
    if not getattr(cls, "_supports_attention_backend", False) or not cls._can_set_attn_implementation():
        raise Unsupported(f"{kind!r}: its attention does not go through transformers' attention interface")
    with torch.device("meta"):
        model = cls._from_config(config)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != config.num_hidden_layers:
        raise Unsupported(f"{kind!r} has no single decoder ModuleList `model.layers` of its "
                          f"{config.num_hidden_layers} layers")
    if not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx") for layer in layers):
        raise Unsupported(f"{kind!r} has decoder layers without a `self_attn` attention (recurrent or mixed layers)")
    for part, owner in (("embed_tokens", base), ("rotary_emb", base), ("lm_head", model)):
        if getattr(owner, part, None) is None:
            raise Unsupported(f"{kind!r} has no `{part}` where the generic path takes it from")
    if not any(getattr(base, name, None) is not None for name in FINAL_NORMS):
        names = "` or `".join(FINAL_NORMS)
        raise Unsupported(f"{kind!r} has no final norm (`{names}`) where the generic path takes it")
