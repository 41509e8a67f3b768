"""Deterministic mode in bf16 (issue 30): speculative output equals plain decoding token for token in every
instance shape, greedy and sampled with a seed, across migration and failover (actors/speculation/coupled.py,
actors/model/deterministic.py). Without deterministic mode these runs differ from plain decoding on this CPU
(tests/unit/test_batch_invariance.py shows it for the same tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from actors.engine.core import Engine
from actors.executors.local import LocalStages
from actors.model.loader import load_metadata, load_model
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from actors.executors.pipeline import PipelineRunner
from actors.speculation.coupled import coupled_tokens, gumbel_noise
from cluster.config import CacheConfig, MigrationConfig, SchedulerConfig, SpeculationConfig
from cluster.migration import MigrationStatus, migrate
from cluster.request import Request, Resume, SamplingParams
from tests.fixtures.tiny_models import DRAFT_NOISE, build_tiny_model, perturbed_copy
from tests.unit.helpers import chi_square, drain, text_prompts
from tests.unit.test_migration import EngineEndpoint, started

TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=TOKENS, ignore_eos=True)
CACHE = CacheConfig(block_size=4, num_blocks=512)
NGRAM = {"method": "ngram", "ngram": {"min_n": 1, "max_n": 3}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny qwen2 in widths our kernels take, and its perturbed copy as a draft (files)."""
    root = tmp_path_factory.mktemp("det")
    target = build_tiny_model("qwen2", root / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    return target, perturbed_copy(target, root / "draft", DRAFT_NOISE)


@pytest.fixture(scope="module")
def models(pair):
    target, draft = pair
    return load_model(str(target), "bf16", weights="dequantized"), load_model(str(draft), "bf16",
                                                                              weights="dequantized")


def runner(model, cache: CacheConfig = CACHE, layers=None, **kw) -> ModelRunner:
    return ModelRunner(model, layers if layers is not None else range(model.num_layers), cache, deterministic=True,
                       **kw)


def stages(model, path: Path, groups: list[list[int]]) -> PipelineRunner:
    last = len(groups) - 1
    parts = [runner(model, layers=g, first=i == 0, last=i == last) for i, g in enumerate(groups)]
    return PipelineRunner(load_metadata(str(path)), CACHE, LocalStages(parts))


def engine(target, draft=None, scheduler: SchedulerConfig = SchedulerConfig(max_batch_size=8),
           prefix_caching: bool = False, **speculation) -> Engine:
    return Engine(target, draft, SpeculationConfig(**speculation), scheduler, prefix_caching=prefix_caching,
                  deterministic=True)


def completions(e: Engine, prompts, params: SamplingParams, batch: int):
    return [c for i in range(0, len(prompts), batch) for c in generate(e, prompts[i:i + batch], params)]


def outputs(e: Engine, prompts, params: SamplingParams, batch: int) -> list[list[int]]:
    return [c.token_ids for c in completions(e, prompts, params, batch)]


@pytest.fixture(scope="module")
def prompts(models) -> list[list[int]]:
    return text_prompts(models[0], 6, offset=3)


@pytest.fixture(scope="module")
def plain(models, prompts) -> dict[str, list[list[int]]]:
    """Plain decoding, one request at a time, greedy and sampled: what every shape must give."""
    target = models[0]
    return {name: outputs(engine(runner(target), policy="off"), prompts, params, 1)
            for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))}


SHAPES = ["model draft", "n-gram", "suffix", "EasySpec draft", "two pipeline stages", "chunked prefill",
          "preempted", "prefix cached"]


def shaped(shape: str, models, pair, policy: str) -> Engine:
    target, draft = models
    if shape == "model draft":
        return engine(runner(target), runner(draft), policy=policy, k=4)
    if shape == "n-gram":
        return engine(runner(target), policy=policy, k=4, **NGRAM)
    if shape == "suffix":
        return engine(runner(target), policy=policy, k=4, method="suffix")
    if shape == "EasySpec draft":
        return engine(runner(target), runner(draft), policy=policy, k=4,
                      draft_parallel={"group_size": 2, "sequential_head": 1, "sequential_tail": 1})
    if shape == "two pipeline stages":
        return engine(stages(target, pair[0], [[0, 1], [2, 3]]), runner(draft), policy=policy, k=4)
    if shape == "chunked prefill":
        return engine(runner(target), runner(draft), SchedulerConfig(max_batch_size=8, max_num_batched_tokens=16),
                      policy=policy, k=4)
    if shape == "preempted":  # 40 blocks of 4 for 4 requests of up to 78 tokens: some are preempted and recomputed
        return engine(runner(target, CacheConfig(block_size=4, num_blocks=40)),
                      runner(draft, CacheConfig(block_size=4, num_blocks=40)), policy=policy, k=4)
    assert shape == "prefix cached"
    return engine(runner(target), runner(draft), prefix_caching=True, policy=policy, k=4)


@pytest.mark.heavy
@pytest.mark.parametrize("params", ["greedy", "sampled"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_equals_plain_decoding_in_bf16(shape: str, params: str, models, pair, prompts, plain) -> None:
    """Fixed k and goodput, one request and four at once: token for token plain decoding's output."""
    sampling = GREEDY if params == "greedy" else SAMPLED
    todo = prompts + prompts[:2] if shape == "prefix cached" else prompts  # the repeats start from cached blocks
    want = plain[params] + plain[params][:2] if shape == "prefix cached" else plain[params]
    for policy in ("fixed", "goodput"):
        for batch in (1, 4):
            e = shaped(shape, models, pair, policy)
            done = completions(e, todo, sampling, batch)
            assert [c.token_ids for c in done] == want, (shape, params, policy, batch)
            if policy == "fixed":
                assert sum(c.stats.accepted for c in done) > 0, "no draft accepted: the test would be vacuous"
            if shape == "preempted" and batch == 4:
                assert e.stats().load.num_preemptions > 0, "nothing was preempted"
            if shape == "prefix cached":
                assert e.stats().prefix_cache.hits > 0, "no prompt started from cached blocks"


@pytest.mark.heavy
def test_a_migrated_request_equals_plain_decoding_greedy_and_sampled(models, prompts, plain) -> None:
    target, draft = models
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        src = engine(runner(target), runner(draft), policy="fixed", k=3)
        dst = engine(runner(target), runner(draft), policy="goodput", k=4)  # a different k after the move
        results = started(src, prompts[:3], params, steps=3)
        outcome = asyncio.run(migrate("r0", EngineEndpoint(src, results, steps=1), EngineEndpoint(dst, results),
                                      MigrationConfig(max_stages=3, stop_copy_tokens=2)))
        assert outcome.status is MigrationStatus.FINISHED, outcome
        drain(src, results)
        drain(dst, results)
        assert [results[f"r{i}"].token_ids for i in range(3)] == plain[name][:3], name


@pytest.mark.heavy
def test_a_failed_over_request_resumes_to_plain_decodings_output_greedy_and_sampled(models, prompts, plain) -> None:
    """Resumed from its tokens alone on another engine (KV recomputed, a fresh generator from the same seed)."""
    target, draft = models
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        src = engine(runner(target), runner(draft), policy="fixed", k=4)
        src.add_request(Request("r", tuple(prompts[0]), params))
        before = drain(src, steps=4)["r"]
        assert 0 < len(before.token_ids) < TOKENS
        dst = engine(runner(target), policy="goodput", k=2, **NGRAM)
        dst.add_request(Request("r", tuple(prompts[0]), params,
                                resume=Resume(tuple(before.token_ids), len(before.text))))
        assert before.token_ids + drain(dst)["r"].token_ids == plain[name][0], name


@pytest.mark.heavy
def test_the_same_seed_gives_the_same_output_run_to_run_and_other_seeds_differ(models, prompts) -> None:
    target, draft = models
    runs = [outputs(engine(runner(target), runner(draft), policy="goodput", k=4), prompts[:2], SAMPLED, 2)
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = outputs(engine(runner(target), runner(draft), policy="goodput", k=4), prompts[:2],
                    SAMPLED.model_copy(update={"seed": 8}), 2)
    assert other != runs[0]


# ---- the draw itself ------------------------------------------------------------------------------
def test_position_keyed_noise_depends_on_the_seed_and_the_position_alone() -> None:
    cpu = torch.device("cpu")
    a = gumbel_noise(5, [3, 4, 5], 50, cpu)  # (3, 50)
    assert torch.equal(a[1:], gumbel_noise(5, [4, 5], 50, cpu))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, gumbel_noise(6, [3, 4, 5], 50, cpu))


@pytest.mark.heavy
@pytest.mark.parametrize("procedure", ["gumbel-max", "negative control: argmax(p + g)"])
def test_coupled_tokens_are_distributed_as_p_and_independent_across_positions(procedure: str) -> None:
    """Over 20,000 seeds the tokens at two positions follow p0 x p1; a wrong draw is caught (the test has power)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)  # (2, V)
    p[0, 2] = 0.0  # a token filtered out (top-k, top-p) is never drawn
    p = p / p.sum(-1, keepdim=True)
    n = 20_000
    if procedure == "gumbel-max":
        tokens = torch.stack([coupled_tokens(p, seed, 10) for seed in range(n)])  # (n, 2)
    else:
        tokens = torch.stack([(p + gumbel_noise(seed, [10, 11], 6, torch.device("cpu"))).argmax(-1)
                              for seed in range(n)])
    pairs = torch.bincount(tokens[:, 0] * 6 + tokens[:, 1], minlength=36).double()  # (36,)
    expected = (p[0][:, None] * p[1][None, :]).reshape(-1).double()  # (36,)
    assert pairs[expected == 0].sum() == 0 or procedure != "gumbel-max"
    fit = chi_square(pairs[expected > 0], expected[expected > 0])[1]
    assert (fit > 1e-3) if procedure == "gumbel-max" else (fit < 1e-3)
