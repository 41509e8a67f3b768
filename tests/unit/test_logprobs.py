"""Logprobs of generated tokens and of prompts: equal to plain decoding's and to a transformers forward, with or
without speculation, batched, with chunked prefill (fp32, the tiny llama)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.core import Engine
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import Request, SamplingParams
from tests.unit.helpers import drain, load, runner, text_prompts

DRAFTS = ("none", "pair", "ngram")


def make_engine(tiny_models, tiny_draft_models, draft: str, budget: int = 256) -> Engine:
    target = load(tiny_models["llama"])
    draft_runner = runner(load(tiny_draft_models["llama"])) if draft == "pair" else None
    spec = SpeculationConfig(policy="off" if draft == "none" else "fixed", k=3,
                             method="ngram" if draft == "ngram" else "model", ngram={"min_n": 1, "max_n": 3})
    return Engine(runner(target), draft_runner, spec, SchedulerConfig(max_num_batched_tokens=budget))


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list]:
    """Each request's tokens, token logprobs and prompt logprobs, from its deltas."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(p), params))
    out = {f"r{i}": {"tokens": [], "logprobs": [], "prompt": None} for i in range(len(prompts))}
    while engine.has_unfinished():
        for d in engine.step():
            o = out[d.request_id]
            o["tokens"] += d.token_ids
            if d.logprobs is not None:
                assert len(d.logprobs) == len(d.token_ids)
                o["logprobs"] += d.logprobs
            if d.prompt_logprobs is not None:
                assert o["prompt"] is None, "prompt logprobs came twice"
                o["prompt"] = d.prompt_logprobs
    return out


def hf_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the whole sequence: row i is the distribution after token i."""
    model = load(path).hf_model
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("draft", DRAFTS)
def test_generated_logprobs_equal_plain_decoding_and_a_transformers_forward(tiny_models, tiny_draft_models,
                                                                          draft) -> None:
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    got = run(make_engine(tiny_models, tiny_draft_models, draft), prompts, params)
    plain = run(make_engine(tiny_models, tiny_draft_models, "none"), prompts, params)
    for i, p in enumerate(prompts):
        g, want = got[f"r{i}"], plain[f"r{i}"]
        assert g["tokens"] == want["tokens"] and len(g["logprobs"]) == len(g["tokens"]) == 12
        ref = hf_logprobs(tiny_models["llama"], p + g["tokens"])
        for j, (a, b) in enumerate(zip(g["logprobs"], want["logprobs"])):
            assert a.token_id == b.token_id == g["tokens"][j]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert a.logprob == pytest.approx(float(ref[len(p) + j - 1, a.token_id]), abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
            assert a.top[0][0] == a.token_id  # greedy: the chosen token is the most likely
        assert g["prompt"] is None


@pytest.mark.parametrize("budget", [256, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_score_the_prompt_without_generating(tiny_models, tiny_draft_models, budget) -> None:
    prompts = text_prompts(load(tiny_models["llama"]), 2, offset=0)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2)
    got = run(make_engine(tiny_models, tiny_draft_models, "pair", budget=budget), prompts, params)
    for i, p in enumerate(prompts):
        g = got[f"r{i}"]
        assert g["tokens"] == [] and len(g["prompt"]) == len(p) and g["prompt"][0] is None
        ref = hf_logprobs(tiny_models["llama"], p)
        for j, lp in enumerate(g["prompt"][1:], start=1):
            assert lp.token_id == p[j]
            assert lp.logprob == pytest.approx(float(ref[j - 1, p[j]]), abs=1e-4)
            assert len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6


def test_sampled_logprobs_are_the_processed_distributions(tiny_models, tiny_draft_models) -> None:
    """A sampled token's logprob is log p under temperature and top-k (vLLM's processed logprobs)."""
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=3)[0]
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=1, logprobs=5, seed=3)
    got = run(make_engine(tiny_models, tiny_draft_models, "pair"), [prompt], params)["r0"]
    ref = (hf_logprobs(tiny_models["llama"], prompt)[-1] / 0.7)
    top5 = ref.topk(5)
    expected = (ref.masked_fill(ref < top5.values[-1], float("-inf"))).log_softmax(-1)
    [lp] = got["logprobs"]
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-4)
    assert sorted(t for t, _ in lp.top) == sorted(top5.indices.tolist())


def test_a_prompt_scored_after_being_preempted_is_scored_once(tiny_models, tiny_draft_models) -> None:
    engine = Engine(runner(load(tiny_models["llama"]), num_blocks=14), None, SpeculationConfig(policy="off"),
                    SchedulerConfig(max_num_batched_tokens=8))
    prompts = text_prompts(engine.target.model, 3, offset=0)
    got = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, ignore_eos=True))
    assert engine.stats().load.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert len(got[f"r{i}"]["prompt"]) == len(p)
