"""Model-free drafters on plain token lists: n-gram prompt lookup and the suffix trie (actors/speculation/lookup.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from actors.speculation.drafters import SuffixDrafter
from actors.speculation.lookup import NgramIndex, OutputCache, SuffixIndex, SuffixTrie, suffix_propose
from cluster.config import SpeculationConfig


def brute_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The longest n (max_n..min_n) whose last-n pattern occurs earlier; the continuation of its latest occurrence,
    and that n (0: none)."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        pattern = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrence tokens[end - n:end], not the final one
            if tokens[end - n:end] == pattern:
                return tokens[end:end + k], n
    return [], 0


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 5]  # the latest earlier "1 2 3" was followed by 7 5
    assert index.match(tokens, 2) == ([7, 5], 3)  # and the evidence behind it: a 3-gram
    assert NgramIndex(1, 3).propose([4, 5, 6], 3) == []  # nothing repeats


def test_ngram_matches_a_brute_force_search_as_tokens_grow() -> None:
    rng = random.Random(0)
    for _ in range(50):
        index = NgramIndex(2, 4)
        tokens = [rng.randrange(5) for _ in range(3)]
        for _ in range(60):  # synced incrementally, as a request's tokens grow
            assert index.match(tokens, 3) == brute_ngram(tokens, 3, 2, 4)
            tokens.append(rng.randrange(5))


def count(tokens: list[int], pattern: list[int]) -> int:
    return sum(tokens[i:i + len(pattern)] == pattern for i in range(len(tokens) - len(pattern) + 1))


def test_suffix_trie_counts_every_substring_up_to_its_depth() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(4) for _ in range(80)]
    trie = SuffixTrie(depth=5)
    active = trie.add(tokens[:30])
    trie.add(tokens[30:], active=active)  # streamed in two pieces, as a request's tokens arrive
    for _ in range(200):
        n, start = rng.randrange(1, 6), rng.randrange(0, 75)
        pattern = tokens[start:start + n]
        node, length = trie.match(pattern, 5)
        assert length == n and node.count == count(tokens, pattern)
    assert trie.match([9], 5) == (trie.root, 0)


def test_suffix_walk_follows_the_most_frequent_continuation_while_probable() -> None:
    own = SuffixIndex(depth=8)
    tokens = [5, 6, 7, 5, 6, 7, 5, 6, 8, 1, 5, 6]  # after "5 6": 7 twice, 8 once
    assert suffix_propose(own, None, tokens, 3, min_prob=0.0) == [7, 5, 6]
    assert suffix_propose(SuffixIndex(8), None, tokens, 3, min_prob=0.7) == []  # p(7 | 5 6) = 2/3 < 0.7
    assert suffix_propose(SuffixIndex(8), None, [1, 2, 3], 3, min_prob=0.0) == []


def test_the_shared_tree_of_recent_outputs_drafts_and_forgets() -> None:
    shared = OutputCache(depth=8, capacity=8)
    shared.add("a", [10, 11, 12, 13])
    assert suffix_propose(SuffixIndex(8), shared.trie("a"), [1, 10, 11], 2, min_prob=0.0) == [12, 13]
    shared.add("a", [20, 21])
    shared.add("a", [30, 31, 32])  # 9 tokens > 8: the first output is evicted, its counts removed
    assert suffix_propose(SuffixIndex(8), shared.trie("a"), [1, 10, 11], 2, min_prob=0.0) == []
    assert not shared.trie("a").root.children.keys() - {20, 21, 30, 31, 32}


def test_a_cleared_output_cache_drafts_nothing_from_earlier_outputs() -> None:
    cache = OutputCache(depth=8, capacity=8)
    cache.add("a", [5, 6, 7, 8, 9])
    own = SuffixIndex(8)
    assert suffix_propose(own, cache.trie("a"), [1, 5, 6], 3, 0.0) == [7, 8, 9]
    cache.clear()
    assert cache.trie("a") is None and not cache.outputs


def test_the_output_cache_is_bounded_in_tokens_and_nodes_whatever_the_outputs() -> None:
    rng = random.Random(0)
    depth, capacity = 6, 500
    cache = OutputCache(depth, capacity)
    for i in range(300):  # far more than fits, outputs of every length, one much longer than the cache
        output = [rng.randrange(50) for _ in range(rng.choice([1, 20, 200, 2000]))]
        cache.add(f"tenant-{i % 3}", output)
        assert cache.tokens <= capacity and sum(len(o) for _, o in cache.outputs) == cache.tokens
        assert cache.size() <= capacity * depth
    # what remains is exactly the trie of what is kept: removing every kept output empties it
    for scope, output in list(cache.outputs):
        cache.tries[scope].add(output, sign=-1)
    assert all(not t.root.children for t in cache.tries.values())


def _seq(rid: str, tenant: str, tokens: list[int]):
    return SimpleNamespace(request_id=rid, request=SimpleNamespace(tenant=tenant), token_ids=tokens,
                           output=SimpleNamespace(token_ids=tokens[3:]))


def test_a_tenant_never_drafts_from_another_tenants_outputs() -> None:
    drafter = SuffixDrafter(SpeculationConfig(method="suffix"))
    secret = [1, 2, 3, 41, 42, 43, 44, 45, 46]
    drafter.release(_seq("a-1", "alice", secret), finished=True)
    probe = [9, 9, 9, 41, 42, 43]
    assert drafter._lookup(_seq("a-2", "alice", probe), 3) == ([44, 45, 46], 3)  # alice drafts from her own outputs
    assert drafter._lookup(_seq("b-1", "bob", probe), 3) == ([], 0)  # bob does not see them
    shared = SuffixDrafter(SpeculationConfig(method="suffix", suffix={"scope": "shared"}))
    shared.release(_seq("a-1", "alice", secret), finished=True)
    assert shared._lookup(_seq("b-1", "bob", probe), 3) == ([44, 45, 46], 3)  # scope: shared (single-tenant setups)
