"""Migration and failover reuse the prefix cache (fp32): a migrating request's full blocks that the destination caches
under the same names are not copied, and a failed-over request re-prefills only what its new instance lacks; the
output stays the unmigrated run's and the target's own greedy output."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.core import Engine
from actors.kv.links import LinkedKV
from actors.engine.offline import generate
from cluster.config import MigrationConfig, SchedulerConfig, SpeculationConfig
from cluster.migration import MigrationStatus, migrate
from cluster.request import Request, Resume, SamplingParams
from tests.unit.helpers import drain, load, reference_greedy, runner, text_prompts
from tests.unit.test_kv_links import TORCH, LinkedEndpoint
from tests.unit.test_migration import assert_no_kv_left, finish_and_check, run_migration, started
from tests.unit.test_pipeline import pipeline

TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
SHARED = 40  # tokens the two prompts share: 10 blocks of 4


def engine(tiny_models, tiny_draft_models, caching: bool = True, split: bool = False) -> Engine:
    """The tiny llama (or its two stages) with its perturbed copy as draft (k = 3), prefix caching on or off."""
    path = tiny_models["llama"]
    target = pipeline(path, [[0, 1], [2, 3]]) if split else runner(load(path))
    return Engine(target, runner(load(tiny_draft_models["llama"])), SpeculationConfig(policy="fixed", k=3),
                  SchedulerConfig(max_batch_size=4), prefix_caching=caching)


def shared_prompts(model) -> tuple[list[int], list[int]]:
    """Two prompts that share their first SHARED tokens, then differ."""
    base, a, b = text_prompts(model, 3, offset=0)  # 40, 9 and 31 tokens
    return base + a, base + b[:7]


@pytest.mark.parametrize("draft_kv", ["move", "rebuild"])
@pytest.mark.parametrize("split", [False, True], ids=["same split", "two-stage destination"])
def test_a_migration_copies_only_the_blocks_the_destination_does_not_cache(tiny_models, tiny_draft_models, split,
                                                                         draft_kv) -> None:
    path = tiny_models["llama"]
    warm, moving = shared_prompts(load(path))
    alone = generate(engine(tiny_models, tiny_draft_models, caching=False), [moving], GREEDY)[0].token_ids
    assert alone == reference_greedy(path, moving, TOKENS)
    cfg = MigrationConfig(max_stages=3, stop_copy_tokens=2, draft_kv=draft_kv)
    outcomes = {}
    for caching in (True, False):
        src, dst = engine(tiny_models, tiny_draft_models, caching), engine(tiny_models, tiny_draft_models, caching,
                                                                           split=split)
        generate(dst, [warm], GREEDY)  # it served a request that starts alike: with caching, its blocks stay

        outcome, results = run_migration(src, dst, GREEDY, [moving], cfg=cfg)

        assert outcome.status is MigrationStatus.FINISHED, outcome
        assert results["r0"].token_ids == alone
        assert_no_kv_left(src, dst)
        outcomes[caching] = outcome
    on, off = outcomes[True], outcomes[False]
    assert (on.tokens_skipped, off.tokens_skipped) == (SHARED, 0)
    assert on.bytes_skipped == SHARED * on.bytes_copied // on.tokens_copied > 0
    assert on.bytes_copied <= 0.5 * off.bytes_copied, (on, off)  # the prompt is most of what the request holds
    assert on.tokens_copied + on.tokens_skipped >= len(moving) and off.tokens_copied >= len(moving)
    assert on.draft_tokens_skipped == SHARED and off.draft_tokens_skipped == 0  # the draft's cache, the same way
    if draft_kv == "move":
        assert on.draft_tokens < off.draft_tokens


def test_a_migration_to_a_destination_that_caches_nothing_of_it_copies_everything(tiny_models,
                                                                                  tiny_draft_models) -> None:
    path = tiny_models["llama"]
    warm, moving = shared_prompts(load(path))
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    generate(dst, [warm[SHARED:] + warm[:SHARED]], GREEDY)  # the same tokens in another order: no name in common

    outcome, results = run_migration(src, dst, GREEDY, [moving])

    assert outcome.status is MigrationStatus.FINISHED and outcome.tokens_skipped == 0, outcome
    assert results["r0"].token_ids == reference_greedy(path, moving, TOKENS)
    assert_no_kv_left(src, dst)


def test_a_failed_over_request_reprefills_only_what_its_new_instance_lacks(tiny_models, tiny_draft_models) -> None:
    """Its instance died after a few steps: it resumes on another (the frontend's Resume: its tokens so far), which
    finds the shared prefix cached and computes the rest."""
    path = tiny_models["llama"]
    warm, moving = shared_prompts(load(path))
    dead, spare = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    generate(spare, [warm], GREEDY)
    results = started(dead, [moving], steps=3)
    so_far = results["r0"]
    assert 0 < len(so_far.token_ids) < TOKENS
    hits = spare.stats().prefix_cache.hits

    spare.add_request(Request("r0", tuple(moving), GREEDY, resume=Resume(tuple(so_far.token_ids), len(so_far.text))))
    drain(spare, results)

    assert results["r0"].token_ids == reference_greedy(path, moving, TOKENS)
    assert spare.stats().prefix_cache.hits - hits == SHARED
    assert spare.target.cache.num_used_blocks == 0


def test_a_migration_over_links_between_different_splits_starts_after_the_cached_blocks(tiny_models,
                                                                                       tiny_draft_models) -> None:
    """Stage to stage over gloo links (actors/kv/links.py): each destination stage starts from the blocks the
    handshake matched, and receives only the rest."""
    path = tiny_models["llama"]
    warm, moving = shared_prompts(load(path))

    def staged(stages: list[list[int]]) -> Engine:
        return Engine(pipeline(path, stages), pipeline(tiny_draft_models["llama"], [[0, 1, 2, 3]]),
                      SpeculationConfig(policy="fixed", k=3), SchedulerConfig(max_batch_size=4), prefix_caching=True)

    src, dst = staged([[0], [1, 2, 3]]), staged([[0, 1], [2, 3]])
    generate(dst, [warm], GREEDY)
    results = started(src, [moving], steps=3)
    a, b = LinkedEndpoint(src, results, steps=1), LinkedEndpoint(dst, results)

    outcome = asyncio.run(migrate("r0", a, b, TORCH, ids=("a", "b")))

    assert outcome.status is MigrationStatus.FINISHED and outcome.transfer == "torch", outcome
    assert outcome.tokens_skipped == SHARED and outcome.draft_tokens_skipped == SHARED
    assert b.payloads and all(isinstance(p, LinkedKV) and p.start >= SHARED for p in b.payloads)
    finish_and_check(src, dst, results, [moving], path)
