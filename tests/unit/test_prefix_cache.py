"""The prefix cache's block accounting (actors/kv/cache.py BlockPool): sharing, ref-counts, eviction, replay."""

from __future__ import annotations

import random

import pytest

from actors.kv.cache import BlockPool
from actors.kv.ledger import KVLedger, replay
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


class _Instance:
    """One instance's cache as the engine drives it: the driver's pool and ledger (the same calls), and a shard that
    replays the ledger's ops with each forward."""

    def __init__(self, num_blocks: int) -> None:
        self.pool, self.shard = BlockPool(num_blocks, BS), BlockPool(num_blocks, BS)
        self.ledger = KVLedger(num_blocks, BS)
        self.tokens: dict[str, list[int]] = {}

    def each(self, fn) -> list:
        return [fn(p) for p in (self.pool, self.ledger)]

    def forward(self, rid: str, length: int) -> None:
        """The shard gets the ops so far with the step, and writes the KV; the driver learns the length after."""
        replay(self.ledger.drain(), self.shard)
        for p in (self.pool, self.ledger, self.shard):
            p.set_length(rid, length)

    def start(self, rid: str, tokens: list[int], names_: list[int]) -> int | None:
        """Start a request holding `tokens` from the cached blocks `names_` find, computing the rest; the tokens
        it found cached, or None (and nothing held) if there is no room."""
        got = self.each(lambda p: p.match(rid, names_))
        assert got[0] == got[1] and got[0] % BS == 0 and got[0] <= len(tokens)
        if not all(self.each(lambda p: p.reserve(rid, len(tokens)))):
            self.each(lambda p: p.free(rid))
            return None
        self.forward(rid, len(tokens))
        self.each(lambda p: p.commit(rid, names(tokens)))
        self.tokens[rid] = tokens
        return got[0]

    def free(self, rid: str) -> None:
        self.each(lambda p: p.free(rid))
        del self.tokens[rid]

    def check(self) -> None:
        replay(self.ledger.drain(), self.shard)
        _check(self.pool, self.tokens)
        pool, ledger, shard = self.pool, self.ledger, self.shard
        assert all(pool.block_table(r) == ledger.block_table(r) == shard.block_table(r) for r in self.tokens)
        assert (pool.num_free_blocks, pool.num_cached_blocks) == (shard.num_free_blocks, shard.num_cached_blocks)


def test_random_lives_keep_every_block_free_cached_or_held_by_exactly_its_holders() -> None:
    """1,000 rounds on two small instances: starts, growth, drafts and crops, commits, finishes, aborts and
    preemptions; migrations (the destination starts the request from the blocks it caches under the request's names,
    the rest is copied, the source lets go); and failovers (an instance dies, its requests restart on the other from
    their tokens, and it comes back empty)."""
    rng = random.Random(5)
    fleet = [_Instance(24), _Instance(24)]
    prompts = [[rng.randrange(6) for _ in range(rng.randint(1, 14))] for _ in range(6)]  # shared prefixes likely
    hits = moved = skipped = failed_over = 0

    for n in range(1000):
        op = rng.random()
        here = rng.choice(fleet)
        there = fleet[1 - fleet.index(here)]
        live = sorted(here.tokens)
        if op < 0.22 or not live:  # start (or resume after preemption) from a prompt
            prompt = list(rng.choice(prompts))
            hits += here.start(f"r{n}", prompt, names(prompt[:-1])) or 0
        elif op < 0.5:  # a round: k drafts written, some accepted, the rest cropped, full blocks named
            rid = rng.choice(live)
            k, have = rng.randint(0, 3), len(here.tokens[rid])
            if all(here.each(lambda p: p.reserve(rid, have + k + 1))):
                here.forward(rid, have + k + 1)
                accepted = rng.randint(0, k)
                here.tokens[rid] += [rng.randrange(6) for _ in range(accepted + 1)]
                here.each(lambda p: p.crop(rid, len(here.tokens[rid])))
                here.each(lambda p: p.commit(rid, names(here.tokens[rid])))
        elif op < 0.62:  # migrate: the handshake matches every full block's name; only the rest is copied
            rid = rng.choice(live)
            cached = there.start(rid, list(here.tokens[rid]), names(here.tokens[rid]))
            if cached is not None:  # else the destination had no room: the request carries on here
                here.free(rid)
                moved += 1
                skipped += cached
        elif op < 0.64:  # failover: `here` dies; its requests restart on `there` from their tokens
            for rid, seq_tokens in sorted(here.tokens.items()):
                failed_over += 1
                hits += there.start(rid, seq_tokens, names(seq_tokens[:-1])) or 0
            fleet[fleet.index(here)] = _Instance(24)
        else:  # finish, abort or preempt: every block released
            here.free(rng.choice(live))
        for inst in fleet:
            inst.check()
    assert hits > 0 and moved > 50 and skipped > 0 and failed_over > 10


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


def test_names_are_128_bits_and_the_tenant_is_part_of_the_root() -> None:
    """A 64-bit name could be collided by a crafted prompt (a birthday search of 2^32 blocks) to poison another
    request's cache: names are 128 bits. The root names the tenant unless the fleet shares its cache."""
    from cluster.config import CacheConfig
    from cluster.prefix import request_root

    chain = block_hashes(list(range(64)), BS, root_hash("m"))
    assert max(h.bit_length() for h in chain) > 64 and all(h < 2**128 for h in chain)
    assert root_hash("m").bit_length() > 64 or root_hash("n").bit_length() > 64
    assert CacheConfig().share_across_tenants is False
    alice, bob = (request_root("m", t, None, share_across_tenants=False) for t in ("alice", "bob"))
    assert alice != bob and alice == request_root("m", "alice", None, share_across_tenants=False)
    assert request_root("m", "alice", None, True) == request_root("m", "bob", None, True) == root_hash("m")
    assert request_root("m", "alice", "s", False) not in (alice, request_root("m", "bob", "s", False))
