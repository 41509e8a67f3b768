"""ModelSize from transformers configs matches the parameter count of the models transformers builds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from placement.model_size import model_size_from_config

SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=100)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96)

CONFIGS: dict[str, tuple[type[PreTrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama-tied": (LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-biases-head-dim": (LlamaConfig, dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "qwen2": (Qwen2Config, {}),
    "qwen2-tied": (Qwen2Config, dict(tie_word_embeddings=True)),
    "mistral-head-dim": (MistralConfig, dict(head_dim=8, sliding_window=24)),
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (Qwen2MoeConfig, QWEN2_MOE),
    "qwen2_moe-no-qkv-bias": (Qwen2MoeConfig, dict(QWEN2_MOE, qkv_bias=False)),
}


def numel(cfg: PreTrainedConfig) -> int:
    torch.manual_seed(0)
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_the_parameter_count_is_exact(case: str) -> None:
    config_class, extra = CONFIGS[case]
    cfg = config_class(**SHAPE, **extra)
    size = model_size_from_config(cfg, name=case)
    assert size.total_params == numel(cfg)
    assert size.name == case and size.num_layers == 3


def test_moe_counts_every_expert_but_a_token_passes_only_the_top_k() -> None:
    size = model_size_from_config(MixtralConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2))
    expert = 3 * 64 * 128
    assert size.params_per_layer - size.active_params_per_layer == 6 * expert
    assert size.layer_flops_per_token == 2 * size.active_params_per_layer


def test_kv_bytes_follow_kv_heads_head_dim_and_dtype() -> None:
    cfg = LlamaConfig(**dict(SHAPE, num_key_value_heads=1), head_dim=32, dtype="bfloat16")
    size = model_size_from_config(cfg)
    assert size.dtype_bytes == 2
    assert size.kv_bytes_per_token_per_layer == 2 * 1 * 32 * 2  # K and V, 1 head of 32, bf16
    assert model_size_from_config(cfg, dtype_bytes=4).kv_bytes_per_token_per_layer == 2 * 1 * 32 * 4


def test_stage_bytes_put_the_embedding_first_and_the_head_last() -> None:
    size = model_size_from_config(Qwen2Config(**SHAPE, tie_word_embeddings=True), dtype_bytes=4)
    layer = size.params_per_layer * 4
    assert size.stage_bytes(2, 0, first=False, last=False) == 2 * layer
    assert size.stage_bytes(2, 0, first=True, last=False) == 2 * layer + 100 * 64 * 4
    assert size.stage_bytes(2, 0, first=False, last=True) == 2 * layer + (64 + 100 * 64) * 4  # its own head copy
    assert size.weight_bytes() == size.total_params * 4  # one device: the tied head is the embedding
    assert size.stage_bytes(1, 10, first=False, last=False) == layer + 10 * size.kv_bytes_per_token_per_layer


def test_a_mixed_qwen2_moe_stack_is_sized_by_its_largest_layer() -> None:
    cfg = Qwen2MoeConfig(**SHAPE, **QWEN2_MOE, mlp_only_layers=[1])
    size = model_size_from_config(cfg)
    assert size.params_per_layer == model_size_from_config(Qwen2MoeConfig(**SHAPE, **QWEN2_MOE)).params_per_layer
    assert size.total_params >= numel(cfg)


def test_an_unsupported_family_is_a_clear_error() -> None:
    class Other(PreTrainedConfig):
        model_type = "gpt2"

    with pytest.raises(ValueError, match="cannot size model type 'gpt2'"):
        model_size_from_config(Other())
