"""On the generic path too, at temperature 0 the engine's output is the target's own greedy output, token for token:
a model draft of the same family, a self-draft by layer subset (EasySpec groups included) and n-gram lookup, batched."""

from __future__ import annotations

import pytest

from actors.offline import generate
from actors.speculation import easyspec
from cluster.config import DraftParallelConfig
from tests.fixtures.tiny_models import GENERIC_FAMILIES
from tests.unit.helpers import text_prompts
from tests.unit.test_lossless import (
    GREEDY,
    NEW_TOKENS,
    PROMPT_OFFSET,
    assert_all_blocks_free,
    assert_matches_reference,
    make_engine,
)


def check(engine, models, family: str, batch_size: int, draft: str) -> None:
    prompts = text_prompts(engine.target.model, batch_size, offset=PROMPT_OFFSET[batch_size])

    completions = generate(engine, prompts, GREEDY)

    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, models[family], prompt, completion, NEW_TOKENS)
    assert_all_blocks_free(engine)
    assert sum(c.stats.proposed for c in completions) > 0
    if draft != "ngram":  # a draft of the same family, or the target's own layers, gets some tokens accepted
        assert sum(c.stats.accepted for c in completions) > 0


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_a_same_family_draft_batched_equals_greedy(tiny_generic_models, tiny_generic_drafts, family: str) -> None:
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, "pair", k=3)
    assert engine.target.model.backend == engine.draft.model.backend == "generic"
    check(engine, tiny_generic_models, family, 4, "pair")


@pytest.mark.heavy
@pytest.mark.parametrize("draft", ["pair", "layers", "ngram"])
@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_greedy_output_equals_the_targets_own(tiny_generic_models, tiny_generic_drafts, family: str,
                                               draft: str) -> None:
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, draft, k=3)
    check(engine, tiny_generic_models, family, 4, draft)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["attention", "layer"])
@pytest.mark.parametrize("family", ["gemma2", "olmo2", "granite"])
def test_an_easyspec_self_draft_equals_greedy(tiny_generic_models, tiny_generic_drafts, family: str,
                                              mode: str) -> None:
    """The self-draft's two layers run as one EasySpec group (fuzzy KV, calibrated after each verification)."""
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, "layers", k=3)
    easyspec.enable(engine.draft, DraftParallelConfig(group_size=2, sequential_head=0, sequential_tail=0, mode=mode))
    check(engine, tiny_generic_models, family, 1, "layers")
