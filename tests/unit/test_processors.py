"""Penalties, logit bias and min_tokens: per position exactly as plain decoding, so speculation keeps them lossless."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.speculation.processors import process
from actors.speculation.sampling import probs_from_logits
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import chi_square, load, reference_greedy, runner, text_prompts

PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.3},
    "bias": {"logit_bias": {11: 6.0, 12: -100.0, 40: 4.0}},
    "min_tokens": {"min_tokens": 16},  # question 13's greedy continuation ends with EOS after 12 tokens
    "all": {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 0.8,
            "logit_bias": {30: 3.0}, "min_tokens": 5},
}


def brute_force(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                stop_ids: list[int]) -> torch.Tensor:
    """One position at a time, by the definitions (HF's repetition penalty, then OpenAI's penalties: vLLM's order)."""
    out = logits.clone()
    v = out.shape[0]
    if params.repetition_penalty != 1.0:
        hf = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        out = hf(torch.tensor([prompt + output]), out[None])[0]
    for t in range(v):
        c = output.count(t)
        out[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    for t, b in params.logit_bias.items():
        out[t] += b
    if len(output) < params.min_tokens:
        out[stop_ids] = float("-inf")
    return out


@pytest.mark.parametrize("name", PENALTIES)
def test_each_position_is_processed_as_if_the_drafts_before_it_were_generated(name) -> None:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(**PENALTIES[name])
    prompt, output, drafts = [3, 5, 7, 5], [11, 40, 11, 9, 2, 30], [11, 30, 12]
    logits = torch.randn(len(drafts) + 1, 64, generator=g) * 3
    got = process(logits, params, prompt, output, drafts, stop_ids=[2, 9])
    for j in range(len(drafts) + 1):
        want = brute_force(logits[j], params, prompt, output + drafts[:j], [2, 9])
        torch.testing.assert_close(got[j], want)


def engine(tiny_models, tiny_draft_models, draft: str) -> Engine:
    target = load(tiny_models["llama"])
    d = runner(load(tiny_draft_models["llama"])) if draft == "pair" else None
    spec = SpeculationConfig(policy="off" if draft == "none" else "fixed", k=3,
                             method="ngram" if draft == "ngram" else "model", ngram={"min_n": 1, "max_n": 3})
    return Engine(runner(target), d, spec, SchedulerConfig())


@pytest.mark.heavy
@pytest.mark.parametrize("name", PENALTIES)
@pytest.mark.parametrize("draft", ["pair", "ngram"])
def test_greedy_output_with_a_processor_equals_plain_decoding_with_it(tiny_models, tiny_draft_models, draft,
                                                                     name) -> None:
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=10)
    params = SamplingParams(temperature=0.0, max_tokens=20, **PENALTIES[name])
    got = [c.token_ids for c in generate(engine(tiny_models, tiny_draft_models, draft), prompts, params)]
    want = [c.token_ids for c in generate(engine(tiny_models, tiny_draft_models, "none"), prompts, params)]
    assert got == want
    plain = [reference_greedy(tiny_models["llama"], p, 20) for p in prompts]
    assert got != plain, "the processor changed nothing: the test checks too little"


def test_repetition_penalty_matches_transformers_generate(tiny_models, tiny_draft_models) -> None:
    model = load(tiny_models["llama"])
    prompt = text_prompts(model, 1, offset=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    got = generate(engine(tiny_models, tiny_draft_models, "pair"), [prompt], params)[0].token_ids
    x = torch.tensor([prompt], device=model.device)
    ref = model.hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                                  repetition_penalty=1.3, min_new_tokens=16)
    assert got == ref[0, len(prompt):].tolist()


def test_min_tokens_holds_eos_back(tiny_models, tiny_draft_models) -> None:
    model = load(tiny_models["llama"])
    prompts = text_prompts(model, 4, offset=13)  # prompts whose greedy continuation ends early with EOS
    ended = [reference_greedy(tiny_models["llama"], p, 24) for p in prompts]
    assert any(len(t) < 16 for t in ended)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=16)
    for c in generate(engine(tiny_models, tiny_draft_models, "pair"), prompts, params):
        assert len(c.token_ids) >= 16
        assert not set(c.token_ids[:16]) & set(model.eos_token_ids)


@pytest.mark.heavy
def test_sampling_with_a_processor_keeps_the_targets_processed_distribution(tiny_models, tiny_draft_models) -> None:
    """The first token of n seeded requests, drafted by the perturbed copy: its histogram against the target's
    processed distribution (bias and presence penalty, temperature 1)."""
    model = load(tiny_models["llama"])
    prompt = text_prompts(model, 1, offset=5)[0]
    extra = {"logit_bias": {int(t): 2.0 for t in range(20, 30)}, "presence_penalty": 1.0}
    n = 3000
    e = engine(tiny_models, tiny_draft_models, "pair")
    params = [SamplingParams(temperature=1.0, max_tokens=1, seed=s, ignore_eos=True, **extra) for s in range(n)]
    firsts = torch.tensor([c.token_ids[0] for c in generate(e, [prompt] * n, params)])
    with torch.inference_mode():
        logits = model.hf_model(torch.tensor([prompt], device=model.device)).logits[0, -1].float()
    p = process(logits[None], SamplingParams(**extra), prompt, [], [], []).softmax(-1)[0]
    counts = torch.bincount(firsts, minlength=p.shape[0]).double()
    keep = p * n >= 5  # bins with enough expected counts; the rest pooled
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([p[keep], p[~keep].sum()[None]])
    _, p_value = chi_square(obs, exp)
    assert p_value > 1e-3


def test_extreme_parameters_give_a_distribution_never_nans() -> None:
    """A temperature or top_p below fp32's least number and a tiny repetition penalty (all in range) used to make
    NaN probabilities, and torch.multinomial then failed the whole engine loop (found by tests/serve/test_fuzz.py)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1e-300, top_p=5e-324, repetition_penalty=5e-324)
    processed = process(logits, params, prompt=[1, 2], output=[3], drafts=[4, 5], stop_ids=[0])
    assert not processed.isinf().any() and not processed.isnan().any()
    probs = probs_from_logits(processed, params)
    assert torch.equal(probs.argmax(-1), processed.argmax(-1)) and torch.allclose(probs.sum(-1), torch.ones(3))
    assert probs.max(-1).values.eq(1).all()  # so cold and so narrow: the most likely token only
