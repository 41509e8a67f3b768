"""Model-free drafts (actors/spec/lookup.py): the lookups against brute force, and the engine with them lossless."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from actors.engine import Engine
from actors.spec.lookup import NgramIndex, SharedSuffixTrie, SuffixDrafter, SuffixTrie
from cluster.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import chi_square, load, runner, text_prompts
from tests.unit.test_lossless import NEW_TOKENS, PROMPT_OFFSET, assert_all_blocks_free, assert_matches_reference
from tests.unit.test_sampling import ALPHA, bucket, target_next_token_probs


def brute_ngram(tokens, k, min_n, max_n):
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return tokens[e:min(e + k, end)]
    return []


def test_ngram_index_matches_brute_force_as_the_list_grows():
    rng = random.Random(0)
    for _ in range(50):
        tokens, index = [], NgramIndex(2, 4)
        for _ in range(60):
            tokens.append(rng.randrange(5))
            k = rng.randrange(1, 6)
            assert index.propose(tokens, k) == brute_ngram(tokens, k, 2, 4)


def brute_counts(seqs, depth):
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def test_suffix_trie_counts_every_substring_up_to_its_depth():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    trie = SuffixTrie(depth=5)
    grown = []
    for t in seqs[0]:  # one sequence fed token by token
        grown.append(t)
        trie.extend(grown)
    for s in seqs[1:]:
        trie.add_sequence(s)
    want = brute_counts(seqs, 5)

    def walk(node, prefix):
        for t, child in node.children.items():
            yield (*prefix, t), child.count
            yield from walk(child, (*prefix, t))

    assert dict(walk(trie.root, ())) == dict(want)


def test_suffix_drafter_follows_the_most_frequent_continuation_of_the_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3, 7, 5, 1, 2, 3]
    d = SuffixDrafter(depth=8)
    # the longest earlier match of the suffix (..., 7, 5, 1, 2, 3)? only "1 2 3" recurs; its continuations are
    # 9 once and 7 twice: 7 wins, then what followed "1 2 3 7" (1 once, 5 once: the smaller id on a tie)
    assert d.propose(tokens, 2) == [7, 1]
    shared = SharedSuffixTrie(depth=8)
    shared.add([4, 4, 1, 2, 3, 6, 6, 6])
    d2 = SuffixDrafter(depth=8, shared=shared)
    assert d2.propose([4, 4, 1, 2, 3], 3) == [6, 6, 6]  # the shared trie holds the longer match


# ---- the engine with model-free drafts ------------------------------------------------------------------
def lookup_engine(path, method: str, k: int = 4, policy: str = "fixed") -> Engine:
    return Engine(runner(load(path)), None, SpeculationConfig(policy=policy, k=k, method=method),
                  SchedulerConfig(max_batch_size=8, max_num_batched_tokens=256))


@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2_moe"])
def test_greedy_output_equals_the_targets_own_with_lookup_drafts(tiny_models, family, method, batch_size):
    engine = lookup_engine(tiny_models[family], method)
    # each prompt twice over: text that repeats, as code and quoted documents do, so lookups find matches
    prompts = [p + p for p in text_prompts(engine.target.model, batch_size, offset=PROMPT_OFFSET[batch_size])]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

    completions = engine.generate(prompts, greedy)

    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, tiny_models[family], prompt, completion, NEW_TOKENS)
    assert_all_blocks_free(engine)
    assert sum(c.stats.proposed for c in completions) > 0 and not engine.lookup.per_request


def test_goodput_policy_with_lookup_drafts_is_lossless(tiny_models):
    engine = lookup_engine(tiny_models["qwen2"], "suffix", policy="goodput")
    prompts = [p + p for p in text_prompts(engine.target.model, 4, offset=PROMPT_OFFSET[4])]
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, tiny_models["qwen2"], prompt, completion, NEW_TOKENS)


def repeating_prompt(model) -> tuple[list[int], int]:
    """A prompt whose last 3 tokens occurred earlier in it, followed by a token t that the target gives
    probability in [0.1, 0.9] next: a lookup proposes t, and both acceptance and rejection happen often."""
    for offset in range(16):
        text = text_prompts(model, 1, offset=offset)[0]
        t = int(target_next_token_probs(model, text).argmax())
        prompt = text + [t] + text[-3:]  # ends as `text` does, which was followed by t
        if 0.1 <= float(target_next_token_probs(model, prompt)[t]) <= 0.9:
            return prompt, t
    raise AssertionError("no prompt of the tiny model fits")


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_first_token_follows_the_targets_distribution_with_lookup_drafts(tiny_models, method):
    n = 800
    model = load(tiny_models["llama"])
    prompt, proposal = repeating_prompt(model)
    engine = lookup_engine(tiny_models["llama"], method, k=2)
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=seed) for seed in range(n)]

    completions = engine.generate([prompt] * n, params)

    first = torch.tensor([c.token_ids[0] for c in completions])
    assert all(c.stats.k_history[0] >= 1 for c in completions)  # every first token went through verification
    accepted = int((first == proposal).sum())
    assert 0.05 * n < accepted < 0.95 * n  # both the accept and the residual path were taken
    p = target_next_token_probs(model, prompt)
    observed, expected, kept = bucket(first, p, n)
    assert kept >= 3 and chi_square(observed, expected)[1] > ALPHA
    # power: a verifier that always kept the looked-up token would be caught
    obs2, exp2, _ = bucket(torch.full((n,), proposal), p, n)
    assert chi_square(obs2, exp2)[1] < ALPHA


def test_config_refuses_a_draft_model_with_a_model_free_method():
    with pytest.raises(ValueError, match="drafts without a model"):
        EngineConfig(model=ModelConfig(target="t", draft_layers=(0,)), speculation=SpeculationConfig(method="ngram"))
