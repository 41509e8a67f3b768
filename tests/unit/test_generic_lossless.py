"""On the generic path too, at temperature 0 the engine's output is the target's own greedy output, token for token:
a model draft of the same family, a self-draft by layer subset (EasySpec groups included) and n-gram lookup, batched,
and across a live migration."""

from __future__ import annotations

import pytest

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.speculation import easyspec
from cluster.config import DraftParallelConfig, SchedulerConfig, SpeculationConfig
from cluster.migration import MigrationStatus
from tests.fixtures.tiny_models import GENERIC_FAMILIES
from tests.unit.helpers import load as load_any
from tests.unit.helpers import reference_greedy, runner, text_prompts
from tests.unit.test_lossless import (
    GREEDY,
    NEW_TOKENS,
    PROMPT_OFFSET,
    assert_all_blocks_free,
    assert_matches_reference,
    make_engine,
)
from tests.unit.test_migration import GREEDY as MIGRATION_GREEDY
from tests.unit.test_migration import TOKENS, assert_no_kv_left, run_migration
from tests.unit.test_pipeline import pipeline


def load(path):
    """The model on the generic path (Qwen3 and Gemma 3 would take the native one)."""
    return load_any(path, "generic")


def check(engine, models, family: str, batch_size: int, draft: str) -> None:
    prompts = text_prompts(engine.target.model, batch_size, offset=PROMPT_OFFSET[batch_size])

    completions = generate(engine, prompts, GREEDY)

    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, models[family], prompt, completion, NEW_TOKENS)
    assert_all_blocks_free(engine)
    assert sum(c.stats.proposed for c in completions) > 0
    if draft != "ngram":  # a draft of the same family, or the target's own layers, gets some tokens accepted
        assert sum(c.stats.accepted for c in completions) > 0


@pytest.mark.parametrize("family", ["gemma3_text", pytest.param("gpt_oss", marks=pytest.mark.heavy)])
def test_a_same_family_draft_batched_equals_greedy(tiny_generic_models, tiny_generic_drafts, family: str) -> None:
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, "pair", k=3, backend="generic")
    assert engine.target.model.backend == engine.draft.model.backend == "generic"
    check(engine, tiny_generic_models, family, 4, "pair")


@pytest.mark.heavy
@pytest.mark.parametrize("draft", ["pair", "layers", "ngram"])
@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_greedy_output_equals_the_targets_own(tiny_generic_models, tiny_generic_drafts, family: str,
                                               draft: str) -> None:
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, draft, k=3, backend="generic")
    check(engine, tiny_generic_models, family, 4, draft)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["attention", "layer"])
@pytest.mark.parametrize("family", ["gemma2", "olmo2", "granite"])
def test_an_easyspec_self_draft_equals_greedy(tiny_generic_models, tiny_generic_drafts, family: str,
                                              mode: str) -> None:
    """The self-draft's two layers run as one EasySpec group (fuzzy KV, calibrated after each verification)."""
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, "layers", k=3, backend="generic")
    easyspec.enable(engine.draft, DraftParallelConfig(group_size=2, sequential_head=0, sequential_tail=0, mode=mode))
    check(engine, tiny_generic_models, family, 1, "layers")


@pytest.mark.heavy
@pytest.mark.parametrize("split", [False, True], ids=["same split", "two-stage destination"])
def test_a_migrated_generic_path_request_equals_the_targets_own(tiny_generic_models, tiny_generic_drafts,
                                                                split: bool) -> None:
    """Live migration (staged KV copies, then stop and copy) of a generic-path request, target and draft KV, to
    another engine (whole, or as two pipeline stages): every request's output is the target's greedy output."""
    path = tiny_generic_models["gemma3_text"]

    def engine(two_stages: bool) -> Engine:
        target = pipeline(path, [[0, 1], [2, 3]], "generic") if two_stages else runner(load(path))
        return Engine(target, runner(load(tiny_generic_drafts["gemma3_text"])), SpeculationConfig(policy="fixed", k=3),
                      SchedulerConfig(max_batch_size=4))

    src, dst = engine(False), engine(split)
    prompts = text_prompts(src.target.model, 3, offset=2)

    outcome, results = run_migration(src, dst, MIGRATION_GREEDY, prompts)

    assert outcome.status is MigrationStatus.FINISHED and outcome.tokens_copied >= len(prompts[0]), outcome
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference_greedy(path, p, TOKENS), f"r{i}"
    assert_no_kv_left(src, dst)
