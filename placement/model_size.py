"""A model's size for placement (parameters and KV bytes per layer, FLOPs per token), computed from its HF config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


class ModelSize(BaseModel):
    """What the planner needs to know about a decoder-only model.

    A stage holding layers [a, b) stores (b - a) layers' weights plus their KV cache; the first stage also
    stores the input embedding (`embed_params`), the last the final norm and the LM head (`head_params`).
    The LM head is counted even when tied to the embedding: a last stage on another device holds its own
    copy. `params_per_layer` is the largest decoder layer (all layers are equal in the supported dense
    and uniform-MoE models; a mixed stack is rounded up so memory checks stay safe).
    `active_params_per_layer` is what one token passes through (for MoE: the router, the top-k experts
    and any shared expert), which sets the FLOPs: 2 per active parameter per token.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    num_layers: int = Field(ge=1)
    params_per_layer: int = Field(ge=1)
    active_params_per_layer: int = Field(ge=1)
    embed_params: int = Field(ge=0)
    head_params: int = Field(ge=0)
    tie_word_embeddings: bool = False
    kv_bytes_per_token_per_layer: int = Field(ge=0)
    dtype_bytes: int = Field(default=2, ge=1)

    @property
    def embedding_params(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, LM head), each tied weight once."""
        return self.embed_params + self.head_params - (self.embed_params if self.tie_word_embeddings else 0)

    @property
    def total_params(self) -> int:
        """All parameters, each tied weight once: what `sum(p.numel() for p in model.parameters())` gives."""
        return self.num_layers * self.params_per_layer + self.embedding_params

    @property
    def layer_flops_per_token(self) -> int:
        return 2 * self.active_params_per_layer

    @property
    def head_flops_per_token(self) -> int:
        return 2 * self.head_params

    def stage_bytes(self, num_layers: int, kv_tokens: int, *, first: bool, last: bool) -> int:
        """Bytes of a stage holding `num_layers` layers with KV for `kv_tokens` tokens; first/last add embed/head."""
        weights = num_layers * self.params_per_layer
        if first:
            weights += self.embed_params
        if last:
            weights += self.head_params
        if first and last and self.tie_word_embeddings:
            weights -= self.embed_params  # one device: the tied LM head is the embedding itself
        return weights * self.dtype_bytes + num_layers * kv_tokens * self.kv_bytes_per_token_per_layer

    def weight_bytes(self) -> int:
        """Bytes of all weights on one device."""
        return self.stage_bytes(self.num_layers, 0, first=True, last=True)


def dtype_bytes_of(dtype: Any, default: int = 2) -> int:
    """Bytes per element of a config's dtype (a torch.dtype or its name); `default` when unset."""
    if dtype is None:
        return default
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def model_size_from_config(cfg: Any, *, name: str | None = None, dtype_bytes: int | None = None) -> ModelSize:
    """The ModelSize of a transformers `PreTrainedConfig` of a supported family (SUPPORTED_MODEL_TYPES).

    Counts exactly the parameters transformers builds: attention (q, k, v, o; q/k/v biases for Qwen2 and
    Qwen2-MoE's `qkv_bias`, all four for Llama's `attention_bias`), the two RMSNorms, and the MLP: dense
    (gate, up, down; biases with `mlp_bias`), Mixtral (router + `num_local_experts` experts of
    `intermediate_size`) or Qwen2-MoE (router + `num_experts` experts of `moe_intermediate_size` + a
    shared expert of `shared_expert_intermediate_size` and its 1-output gate; dense layers where
    `mlp_only_layers` or `decoder_sparse_step` say so). `dtype_bytes` defaults to the config's dtype, else 2.
    KV is reserved for every token, also under Mistral's sliding window (a safe upper bound).
    """
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"cannot size model type {model_type!r}: supported are {list(SUPPORTED_MODEL_TYPES)}")
    h: int = cfg.hidden_size
    heads: int = cfg.num_attention_heads
    kv_heads: int = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim: int = getattr(cfg, "head_dim", None) or h // heads
    vocab: int = cfg.vocab_size
    nbytes = dtype_bytes if dtype_bytes is not None else dtype_bytes_of(getattr(cfg, "dtype", None))

    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h
    if model_type == "qwen2" or getattr(cfg, "qkv_bias", False):
        attention += q + 2 * kv
    if getattr(cfg, "attention_bias", False):  # Llama: biases on q, k, v and o
        attention += q + 2 * kv + h
    norms = 2 * h

    def dense_mlp(inter: int, bias: bool = False) -> int:
        return 3 * h * inter + ((2 * inter + h) if bias else 0)

    dense = dense_mlp(cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)))
    layers: list[tuple[int, int]] = []  # (params, active params) per layer
    for index in range(cfg.num_hidden_layers):
        if model_type == "mixtral":
            experts, top_k = cfg.num_local_experts, cfg.num_experts_per_tok
            expert = dense_mlp(cfg.intermediate_size)
            mlp, active = h * experts + experts * expert, h * experts + top_k * expert
        elif model_type == "qwen2_moe" and _qwen2_moe_sparse(cfg, index):
            experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
            expert = dense_mlp(cfg.moe_intermediate_size)
            shared = dense_mlp(cfg.shared_expert_intermediate_size) + h if cfg.shared_expert_intermediate_size else 0
            mlp = h * experts + experts * expert + shared
            active = h * experts + top_k * expert + shared
        else:
            mlp = active = dense
        layers.append((attention + norms + mlp, attention + norms + active))

    return ModelSize(
        name=name or getattr(cfg, "name_or_path", "") or model_type,
        num_layers=cfg.num_hidden_layers,
        params_per_layer=max(p for p, _ in layers),
        active_params_per_layer=max(a for _, a in layers),
        embed_params=vocab * h,
        head_params=h + vocab * h,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        kv_bytes_per_token_per_layer=2 * kv * nbytes,
        dtype_bytes=nbytes,
    )


def _qwen2_moe_sparse(cfg: Any, index: int) -> bool:
    """Whether Qwen2-MoE layer `index` has experts (the rule in transformers' Qwen2MoeDecoderLayer)."""
    only_dense = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return index not in only_dense and cfg.num_experts > 0 and (index + 1) % step == 0
