"""Shared helpers of the data-plane unit tests: cached model loading, real-text prompts, HF references, chi-square."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from actors.engine.core import Engine
from actors.model import cpu_kernels
from actors.model.loader import LoadedModel, load_model
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from cluster.request import FinishReason

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "mt_bench_questions.jsonl"
# The first 100 characters of the first 16 questions' first turns: the prompts below only use their first
# 40 tokens, so the tests run the same where the dataset is not next to the checkout.
_MT_BENCH_HEADS = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experience",
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' yo",
    "Imagine you are writing a blog post comparing two popular smartphone models. Develop an outline for ",
    "Write a persuasive email to convince your introverted friend, who dislikes public speaking, to volun",
    "Describe a vivid and unique character, using strong imagery and creative language. Please answer in ",
    "Write a descriptive paragraph about a bustling marketplace, incorporating sensory details such as sm",
    "Could you write a captivating short story beginning with the sentence: The old abandoned house at th",
    "Craft an intriguing opening paragraph for a fictional short story. The story should involve a charac",
    "Help me construct a catchy, yet scientifically accurate, headline for an article on the latest disco",
    "Edit the following paragraph to correct any grammatical errors:\nShe didn't remembre where is her pur",
    "Pretend yourself to be Elon Musk in all the following conversations. Speak like Elon Musk as much as",
    "Embrace the role of Sheldon from \"The Big Bang Theory\" as we delve into our conversation. Don’t star",
    "Imagine yourself as a doctor tasked with devising innovative remedies for various ailments and malad",
    "Please take on the role of a relationship coach. You'll be provided with details about two individua",
    "Please assume the role of an English translator, tasked with correcting and enhancing spelling and l",
    "Now you are a machine learning engineer. Your task is to explain complex machine learning concepts i",
)
# Prompt length in tokens of question i: all different, several beyond mistral's sliding window of 24. Some
# were picked so that the tiny models' greedy continuation ends with EOS within 24 tokens: question 5
# (mixtral), 6 (qwen2, mixtral), 7 (qwen2_moe, at once), 10 and 12 (qwen2), 11 (mistral), 13 (llama, mistral).
PROMPT_LENGTHS = (40, 9, 31, 17, 26, 35, 16, 20, 3, 38, 8, 21, 13, 7, 12, 28)


# The device the data-plane tests put their models on: `SPECFLEET_TEST_DEVICE=cuda pytest tests/unit` runs the
# same tests (lossless included) on a GPU; the default is the CPU, where CI runs.
TEST_DEVICE = torch.device(os.environ.get("SPECFLEET_TEST_DEVICE", "cpu"))


@functools.cache
def load(path: str | Path, backend: str = "auto") -> LoadedModel:
    """load_model(path, "fp32") onto TEST_DEVICE on the `backend` path, once per path and path per session (tests never
    modify a loaded model)."""
    return load_model(str(path), "fp32", device=TEST_DEVICE, backend=backend)  # type: ignore[arg-type]


@functools.cache
def question_texts() -> tuple[str, ...]:
    """First turns of the MT-Bench questions (their built-in heads if the dataset is not on this machine)."""
    if not MT_BENCH.exists():
        return _MT_BENCH_HEADS
    return tuple(json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip())


def text_prompts(model: LoadedModel, n: int, offset: int = 0) -> list[list[int]]:
    """Questions offset..offset+n-1 as prompts, tokenized by the model's tokenizer, cut to PROMPT_LENGTHS."""
    texts = question_texts()
    prompts = []
    for i in range(offset, offset + n):
        ids = model.tokenizer.encode(texts[i % len(texts)])
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        assert len(ids) >= length, "every question is longer than 40 tiny-tokenizer tokens"
        prompts.append(ids[:length])
    return prompts


@functools.cache
def _reference(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = load(path)
    out = model.hf_model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        do_sample=False, max_new_tokens=max_new_tokens,
    )
    return tuple(out[0, len(prompt):].tolist())


def reference_greedy(path: str | Path, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt` by the model at `path` (stops after EOS)."""
    return list(_reference(str(path), tuple(prompt), max_new_tokens))


def runner(model: LoadedModel, layers: Sequence[int] | None = None, block_size: int = 4,
           num_blocks: int = 256, first: bool = True, last: bool = True) -> ModelRunner:
    layers = range(model.num_layers) if layers is None else layers
    return ModelRunner(model, layers, CacheConfig(block_size=block_size, num_blocks=num_blocks), first=first, last=last)


@dataclass
class Result:
    """What the deltas of one request added up to."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_step: int | None = None  # the step that emitted its first token


def drain(engine: Engine, results: dict[str, Result] | None = None, steps: int | None = None,
          start_step: int = 0, check: Callable[[Engine], None] | None = None) -> dict[str, Result]:
    """Step `engine` `steps` times, or until nothing is left, accumulating each request's deltas into `results`;
    `check(engine)` runs after every step."""
    results = {} if results is None else results
    limit = 2000 if steps is None else steps
    for step in range(start_step, start_step + limit):
        if not engine.has_unfinished():
            return results
        for delta in engine.step():
            r = results.setdefault(delta.request_id, Result())
            assert r.finish_reason is None, f"{delta.request_id} got a delta after it finished"
            if delta.token_ids and r.first_step is None:
                r.first_step = step
            r.token_ids.extend(delta.token_ids)
            r.text += delta.text
            r.finish_reason, r.error = delta.finish_reason, delta.error
        if check is not None:
            check(engine)
    if steps is None:
        raise AssertionError(f"the engine did not finish within {limit} steps")
    return results


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square statistic of counts against probabilities, and its p-value (df = bins - 1).

    p-value = P(chi2_df >= stat) = Q(df/2, stat/2), the regularized upper incomplete gamma function.
    """
    observed = observed.double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    assert (expected >= 5).all(), f"bins with fewer than 5 expected counts: {expected}"
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)
    return float(stat), float(p_value)


def isa_params(*extra: str) -> list:
    """One parameter per ISA of ours (avx512, avx2), each skipped, with the reason, where this CPU or machine cannot
    run it; `extra` (e.g. "torch") added as they are. For `@pytest.mark.parametrize("kernel_isa", ..., indirect=True)`."""
    params = [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        cpu_kernels.unavailable(isa) is not None, reason=f"{isa}: {cpu_kernels.unavailable(isa)}"))
        for isa in cpu_kernels.ISAS]
    return params + [pytest.param(name, id=name) for name in extra]
