"""The tiny-model fixtures load through transformers and have the properties other tests rely on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from tests.fixtures.tiny_models import DRAFT_AGREEMENT, FAMILIES, build_tiny_model, build_tokenizer

TEXT = "The keeper counted 112 steps.\n\tdef f(x):\n        return x ** 2  # café ☕, naïve   end "
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
CHAT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = ("The lighthouse keeper", "def fibonacci(n: int)", "Speculative decoding lets")


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids drawn from the non-special part of the vocabulary (ids 0-2 are special)."""
    return torch.randint(3, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_model_loads_as_its_family_with_consistent_token_ids(tiny_models, family: str) -> None:
    model = load(tiny_models[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    generation = GenerationConfig.from_pretrained(tiny_models[family])

    assert model.config.model_type == family
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(model.config, name) == getattr(generation, name) == getattr(tokenizer, name) == 0


def test_family_specifics(tiny_models) -> None:
    configs = {family: load(tiny_models[family]).config for family in FAMILIES}

    assert configs["qwen2"].tie_word_embeddings and not configs["llama"].tie_word_embeddings
    assert configs["mistral"].sliding_window == 24
    assert (configs["mixtral"].num_local_experts, configs["mixtral"].num_experts_per_tok) == (4, 2)
    moe = configs["qwen2_moe"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 64)
    assert moe.shared_expert_intermediate_size == 128 and not moe.norm_topk_prob
    for config in configs.values():
        assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_next_token_logits_are_well_separated(tiny_models, family: str) -> None:
    model = load(tiny_models[family])
    top2 = logits(model, random_ids(model.config.vocab_size, 4, 32)).topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]

    assert gaps.min() > 1e-4
    assert gaps.median() > 0.1


def test_tokenizer_round_trips_text_and_renders_chat(tiny_models) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])

    assert 300 <= len(tokenizer) <= 400
    ids = tokenizer.encode(TEXT)
    assert len(ids) < len(TEXT.encode()), "BPE merges should shorten the text"
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == CHAT
    chat_ids = tokenizer.encode(CHAT)
    assert chat_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(chat_ids) == CHAT


def test_builds_are_deterministic(tmp_path: Path) -> None:
    first, second = (build_tiny_model("qwen2_moe", tmp_path / name, seed=3) for name in ("a", "b"))
    other_seed = build_tiny_model("qwen2_moe", tmp_path / "c", seed=4)

    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()
    weights = [load_file(path / "model.safetensors") for path in (first, second, other_seed)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    assert build_tokenizer(tmp_path / "tok").get_vocab() == AutoTokenizer.from_pretrained(first).get_vocab()


@pytest.mark.heavy
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_does_not_collapse(tiny_models, family: str) -> None:
    model = load(tiny_models[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    distinct = []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
        distinct.append(len(set(output[0, inputs["input_ids"].shape[1] :].tolist())))

    assert max(distinct) >= 5, distinct


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_agrees_with_target_partly(tiny_models, tiny_draft_models, family: str) -> None:
    target, draft = load(tiny_models[family]), load(tiny_draft_models[family])
    ids = random_ids(target.config.vocab_size, 8, 32, seed=1)
    agreement = (logits(target, ids).argmax(-1) == logits(draft, ids).argmax(-1)).float().mean().item()

    low, high = DRAFT_AGREEMENT
    assert low <= agreement <= high


def test_mistral_sliding_window_bounds_the_context(tiny_models) -> None:
    model = load(tiny_models["mistral"])
    ids = random_ids(model.config.vocab_size, 1, 120, seed=2)
    changed = ids.clone()
    changed[0, 0] = ids[0, 0] % (model.config.vocab_size - 4) + 4
    before, after = logits(model, ids), logits(model, changed)
    # each layer sees `sliding_window` tokens back, so the first token reaches 4 * 23 = 92 positions on
    reach = model.config.num_hidden_layers * (model.config.sliding_window - 1)

    assert not torch.allclose(before[0, 1:24], after[0, 1:24])
    torch.testing.assert_close(before[0, reach + 1 :], after[0, reach + 1 :], rtol=0, atol=1e-6)


def test_gguf_loads_back_with_equal_logits_and_tokens(tiny_models, tiny_gguf: Path) -> None:
    source = load(tiny_models["llama"])
    source_tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    loaded = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)

    assert loaded.config.model_type == "llama" and loaded.dtype == torch.float32
    ids = random_ids(source.config.vocab_size, 2, 40, seed=3)
    torch.testing.assert_close(logits(loaded, ids), logits(source, ids), rtol=0, atol=1e-5)
    for text in (TEXT, CHAT, "  leading and trailing  \n\n"):
        assert tokenizer.encode(text) == source_tokenizer.encode(text)
    assert tokenizer.decode(source_tokenizer.encode(TEXT)) == TEXT
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == CHAT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0, 0)
