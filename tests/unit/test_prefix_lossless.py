"""Prefix caching keeps the promise: with it on, every output equals caching off and the target's greedy output.

Prompts share prefixes of every length relative to the block size (4 tokens here): shorter than a block, exactly
one, one plus a token, several plus a partial one, and the whole prompt again. They run one after another (each
finds the earlier ones' blocks cached) and all at once (a request finds what a neighbour committed), over one
runner, a pipeline of stages, with a draft model, an n-gram drafter and an EasySpec layer-parallel draft, with
chunked prefill, and in a cache so small that requests are preempted and recomputed from cached blocks.
"""

from __future__ import annotations

import pytest

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.speculation import easyspec
from cluster.config import DraftParallelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import load, reference_greedy, runner, text_prompts
from tests.unit.test_pipeline import pipeline

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SHARED = (3, 4, 5, 10, 40)  # tokens each prompt shares with the first: < 1 block, 1, 1 + 1, 2.5, all of it


def prompts(model) -> list[list[int]]:
    base, other = text_prompts(model, 2, offset=0)  # 40 and 9 tokens (helpers.PROMPT_LENGTHS)
    return [base] + [base[:n] + other[: 12 - n % 4] for n in SHARED[:-1]] + [list(base)]


def make_engine(tiny_models, tiny_draft_models, draft: str, caching: bool, num_blocks: int = 256,
                max_num_batched_tokens: int = 256, stages: bool = False,
                share: bool = False) -> Engine:
    path = tiny_models["llama"]
    target = pipeline(path, [[0, 1], [2, 3]]) if stages else runner(load(path), num_blocks=num_blocks)
    draft_runner = None
    if draft in ("pair", "easyspec"):
        draft_runner = runner(load(tiny_draft_models["llama"]), num_blocks=num_blocks)
        if draft == "easyspec":
            easyspec.enable(draft_runner, DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=1))
    method = "ngram" if draft == "ngram" else "model"
    policy = "off" if draft == "none" else "fixed"
    spec = SpeculationConfig(policy=policy, k=3, method=method, ngram={"min_n": 1, "max_n": 3},
                             draft_parallel=DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=1)
                             if draft == "easyspec" else DraftParallelConfig())
    return Engine(target, draft_runner, spec, SchedulerConfig(max_batch_size=8,
                                                              max_num_batched_tokens=max_num_batched_tokens),
                  prefix_caching=caching, share_across_tenants=share)


def outputs(engine: Engine, ps: list[list[int]], together: bool) -> list[list[int]]:
    if together:
        return [c.token_ids for c in generate(engine, ps, GREEDY)]
    return [generate(engine, [p], GREEDY)[0].token_ids for p in ps]


SHAPES = [("none", {}), ("pair", {}), ("ngram", {}), ("easyspec", {}), ("pair", {"stages": True}),
          ("pair", {"max_num_batched_tokens": 8}), ("pair", {"num_blocks": 24})]


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
@pytest.mark.parametrize(("draft", "shape"), SHAPES,
                         ids=["plain", "draft", "ngram", "easyspec", "pipeline", "chunked", "preempted"])
def test_caching_on_equals_caching_off_and_the_reference(tiny_models, tiny_draft_models, draft, shape,
                                                         together) -> None:
    cached = make_engine(tiny_models, tiny_draft_models, draft, True, **shape)
    plain = make_engine(tiny_models, tiny_draft_models, draft, False, **shape)
    ps = prompts(cached.target.model)

    got = outputs(cached, ps, together)

    assert got == outputs(plain, ps, together)
    for p, out in zip(ps, got):
        assert out == reference_greedy(tiny_models["llama"], p, GREEDY.max_tokens)
    stats = cached.stats()
    assert stats.prefix_cache.queries >= sum(len(p) for p in ps)
    if not together:  # admitted in one step, requests find nothing cached yet: their blocks are committed twice
        assert stats.prefix_cache.hits > 0
    assert plain.stats().prefix_cache.hits == 0
    assert cached.target.cache.num_used_blocks == 0 and cached.target.cache.num_cached_blocks > 0
    if shape.get("num_blocks") and together:
        assert stats.load.num_preemptions > 0, "the small cache was meant to preempt"


def test_hits_follow_the_shared_prefix_block_by_block(tiny_models, tiny_draft_models) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, "none", True)
    ps = prompts(engine.target.model)
    generate(engine, [ps[0]], GREEDY)
    hits = []
    for p in ps[1:]:
        before = engine.stats().prefix_cache.hits
        generate(engine, [p], GREEDY)
        hits.append(engine.stats().prefix_cache.hits - before)
    assert hits == [0, 4, 4, 8, 36]  # whole blocks of the shared prefix; the whole prompt leaves its last block


def test_a_salt_keeps_tenants_apart(tiny_models, tiny_draft_models) -> None:
    from cluster.request import Request

    engine = make_engine(tiny_models, tiny_draft_models, "none", True)
    p = prompts(engine.target.model)[0]
    for i, salt in enumerate(("a", "b", "a")):
        engine.add_request(Request(f"r{i}", tuple(p), GREEDY, cache_salt=salt))
        while engine.has_unfinished():
            engine.step()
    assert engine.stats().prefix_cache.hits == 36  # only the third, salted like the first, found it


def test_tenants_do_not_share_cached_blocks_unless_the_fleet_says_so(tiny_models, tiny_draft_models) -> None:
    """The tenant (an API key's name) is part of a block's name by default: a prompt another key sent finds nothing
    cached, one its own key sent finds its blocks; `share_across_tenants` (a single-tenant fleet) shares them."""
    from cluster.request import Request

    for share, expected in ((False, 36), (True, 72)):
        engine = make_engine(tiny_models, tiny_draft_models, "none", True, share=share)
        p = prompts(engine.target.model)[0]
        for i, tenant in enumerate(("alice", "bob", "alice")):
            engine.add_request(Request(f"r{i}", tuple(p), GREEDY, tenant=tenant))
            while engine.has_unfinished():
                engine.step()
        assert engine.stats().prefix_cache.hits == expected, share
