"""ModelRunner logits equal transformers' reference forward for every family: chunked, staged and from GGUF."""

from __future__ import annotations

import pytest
import torch

from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from tests.fixtures.tiny_models import FAMILIES
from tests.unit.helpers import load, runner, text_prompts

ATOL = 1e-4


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """(T, V) logits of transformers' own forward over one unpadded prompt."""
    return model.hf_model(torch.tensor([prompt])).logits[0].float()


def ragged_prompts(model) -> list[list[int]]:
    """3 real-text prompts of different lengths; the longest exceeds mistral's 24-token sliding window."""
    prompts = text_prompts(model, 3)  # lengths 40, 9, 31
    assert len({len(p) for p in prompts}) == 3
    return prompts


def run_in_two_chunks(stages: list[ModelRunner], prompts: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
    """Feed each prompt's first `split` tokens, then the rest, through the stages; logits of every position."""
    ids = [f"r{i}" for i in range(len(prompts))]
    per_prompt: list[list[torch.Tensor]] = [[] for _ in prompts]
    for part in (0, 1):
        pieces = [p[:s] if part == 0 else p[s:] for p, s in zip(prompts, splits)]
        chunks = [SeqChunk(rid, tuple(piece), num_logits=len(piece)) for rid, piece in zip(ids, pieces)]
        hidden = None
        for stage in stages:
            out = stage.forward(chunks, hidden)
            hidden = out
        logits = out.split([len(piece) for piece in pieces])
        for acc, chunk_logits in zip(per_prompt, logits):
            acc.append(chunk_logits)
    for stage in stages:
        assert [stage.cache.length(rid) for rid in ids] == [len(p) for p in prompts]
    return [torch.cat(parts) for parts in per_prompt]


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_matches_transformers_on_a_ragged_chunked_batch(tiny_models, family: str) -> None:
    model = load(tiny_models[family])
    prompts = ragged_prompts(model)
    got = run_in_two_chunks([runner(model)], prompts, splits=[25, 1, 13])

    for prompt, logits in zip(prompts, got):
        assert logits.shape == (len(prompt), model.config.vocab_size)
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_pipeline_stages_give_the_whole_models_logits(tiny_models, family: str) -> None:
    model = load(tiny_models[family])
    prompts = ragged_prompts(model)
    first = runner(model, [0, 1], first=True, last=False)
    second = runner(model, [2, 3], first=False, last=True)
    assert first.cache.layer_ids == [0, 1] and second.cache.layer_ids == [2, 3]

    got = run_in_two_chunks([first, second], prompts, splits=[30, 4, 2])

    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


def test_first_stage_returns_hidden_states(tiny_models) -> None:
    model = load(tiny_models["llama"])
    stage = runner(model, [0, 1], last=False)
    hidden = stage.forward([SeqChunk("a", (5, 6, 7)), SeqChunk("b", (8,))])

    assert hidden.shape == (4, model.config.hidden_size)  # (N, H): the chunks' tokens packed, no padding


def test_runner_rejects_layers_outside_the_model(tiny_models) -> None:
    model = load(tiny_models["llama"])
    for layers in ([4], [-1], []):
        with pytest.raises(ValueError, match="layers"):
            runner(model, layers)


def test_gguf_checkpoint_runs_like_the_safetensors_model_it_came_from(tiny_models, tiny_gguf) -> None:
    source = load(tiny_models["llama"])
    gguf_model = load(tiny_gguf)
    assert gguf_model.config.model_type == "llama"
    assert gguf_model.config.num_hidden_layers == source.config.num_hidden_layers
    prompts = ragged_prompts(source)
    assert [gguf_model.tokenizer.encode(source.tokenizer.decode(p)) for p in prompts] == prompts

    got = run_in_two_chunks([runner(gguf_model)], prompts, splits=[20, 5, 30])

    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(source, prompt), rtol=0, atol=ATOL)
