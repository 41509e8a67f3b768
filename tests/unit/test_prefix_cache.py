"""The prefix cache's block accounting (actors/kv_cache.py BlockPool): sharing, ref-counts, eviction, replay."""

from __future__ import annotations

import random

import pytest

from actors.kv_cache import BlockPool
from actors.kv_ledger import KVLedger, replay
from cluster.prefix import block_hashes, root_hash

BS = 4
ROOT = root_hash("m")


def names(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, BS, ROOT)


def run(pool: BlockPool, rid: str, tokens: list[int], prompt: int | None = None) -> int:
    """A request's life until it holds `tokens`: reuse a cached prefix of its prompt, reserve, write, commit."""
    prompt = len(tokens) if prompt is None else prompt
    cached = pool.match(rid, names(tokens[: prompt - 1]))
    assert pool.reserve(rid, len(tokens))
    pool.set_length(rid, len(tokens))
    pool.commit(rid, names(tokens))
    return cached


def test_a_shared_prefix_is_reused_and_its_blocks_are_shared() -> None:
    pool = BlockPool(32, BS)
    a = list(range(10))  # two full blocks and a partial one
    assert run(pool, "a", a) == 0
    b = a[:8] + [50, 51, 52]
    assert run(pool, "b", b) == 8  # both full blocks of a's prompt
    assert pool.block_table("a")[:2] == pool.block_table("b")[:2]
    assert pool.block_table("a")[2] != pool.block_table("b")[2]  # the partial block is private
    assert pool.num_used_blocks == 4


def test_a_whole_prompt_in_the_cache_still_leaves_its_last_token_to_run() -> None:
    pool = BlockPool(32, BS)
    run(pool, "a", list(range(8)))
    pool.free("a")
    assert run(pool, "b", list(range(8))) == 4  # 8 tokens cached, but the 8th must run to give logits


def test_freed_blocks_stay_cached_until_space_is_needed_tail_first() -> None:
    pool = BlockPool(7, BS)  # 6 usable blocks
    run(pool, "a", list(range(12)))  # 3 named blocks
    pool.free("a")
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    assert pool.reserve("x", 4 * BS)  # 3 unnamed free blocks, then the least recently released cached one
    events = pool.take_events()
    a = names(list(range(12)))  # named, then a's tail evicted first: each name under its latest change
    assert list(events.stored) == a[:2] and list(events.removed) == [a[2]]
    assert not events.lost and not pool.take_events().stored
    pool.free("x")
    assert run(pool, "b", list(range(12)) + [9]) == 8  # its head is still there
    with pytest.raises(ValueError, match="already holds KV"):
        pool.match("b", names(list(range(12))))


def test_crop_never_reaches_into_shared_blocks() -> None:
    pool = BlockPool(32, BS)
    run(pool, "a", list(range(9)))
    with pytest.raises(ValueError, match="shared"):
        pool.crop("a", 7)
    pool.crop("a", 8)
    assert pool.length("a") == 8


def test_one_block_per_name_the_second_copy_stays_private() -> None:
    pool = BlockPool(32, BS)
    for rid in ("a", "b"):  # both prefill the same prompt before either commits
        assert pool.match(rid, names(list(range(7)))) == 0
        assert pool.reserve(rid, 8)
        pool.set_length(rid, 8)
    pool.commit("a", names(list(range(8))))
    pool.commit("b", names(list(range(8))))
    pool.free("a")
    pool.free("b")
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 31


def test_random_lives_keep_every_block_free_cached_or_held_by_exactly_its_holders() -> None:
    """1,000 rounds of starts, growth, drafts and crops, commits, finishes, aborts and preemptions on a small pool."""
    rng = random.Random(5)
    pool = BlockPool(24, BS)
    ledger, shard = KVLedger(24, BS), BlockPool(24, BS)
    prompts = [[rng.randrange(6) for _ in range(rng.randint(1, 14))] for _ in range(6)]  # shared prefixes likely
    tokens: dict[str, list[int]] = {}
    hits = 0

    def forward(rid: str, length: int) -> None:
        """The shard gets the ops so far with the step, and writes the KV; the driver learns the length after."""
        replay(ledger.drain(), shard)
        for p in (pool, ledger, shard):
            p.set_length(rid, length)

    for n in range(1000):
        op = rng.random()
        live = sorted(tokens)
        if op < 0.25 or not live:  # start (or resume after preemption) from a prompt
            rid, prompt = f"r{n}", list(rng.choice(prompts))
            got = [p.match(rid, names(prompt[:-1])) for p in (pool, ledger)]
            assert got[0] == got[1]
            hits += got[0]
            if all(p.reserve(rid, len(prompt)) for p in (pool, ledger)):
                forward(rid, len(prompt))
                for p in (pool, ledger):
                    p.commit(rid, names(prompt))
                tokens[rid] = prompt
            else:
                for p in (pool, ledger):
                    p.free(rid)
        elif op < 0.55:  # a round: k drafts written, some accepted, the rest cropped, full blocks named
            rid = rng.choice(live)
            k, have = rng.randint(0, 3), len(tokens[rid])
            if all(p.reserve(rid, have + k + 1) for p in (pool, ledger)):
                forward(rid, have + k + 1)
                accepted = rng.randint(0, k)
                tokens[rid] += [rng.randrange(6) for _ in range(accepted + 1)]
                for p in (pool, ledger):
                    p.crop(rid, len(tokens[rid]))
                    p.commit(rid, names(tokens[rid]))
        else:  # finish, abort or preempt: every block released
            rid = rng.choice(live)
            for p in (pool, ledger):
                p.free(rid)
            del tokens[rid]
        replay(ledger.drain(), shard)
        _check(pool, tokens)
        assert all(pool.block_table(r) == ledger.block_table(r) == shard.block_table(r) for r in tokens)
        assert (pool.num_free_blocks, pool.num_cached_blocks) == (shard.num_free_blocks, shard.num_cached_blocks)
    assert hits > 0


def _check(pool: BlockPool, tokens: dict[str, list[int]]) -> None:
    held: dict[int, int] = {}
    for rid, seq_tokens in tokens.items():
        table = pool.block_table(rid)
        assert len(table) == pool.blocks_for(pool.length(rid)) and pool.length(rid) == len(seq_tokens)
        for b in table:
            held[b] = held.get(b, 0) + 1
        for i, b in enumerate(table[: pool.named_blocks(rid)]):  # a shared block holds what its name says
            assert pool._name.get(b, names(seq_tokens)[i]) == names(seq_tokens)[i]
    free, cached = set(pool._free), set(pool._cached)
    assert not free & cached and not (free | cached) & held.keys()
    assert len(free) + len(cached) + len(held) == pool.num_blocks
    assert all(pool._refs[b] == held.get(b, 0) for b in range(pool.num_blocks))
    assert cached <= pool._name.keys() and not free & pool._name.keys()
    assert {pool._block[n]: n for n in pool._block} == pool._name
