"""Cache-aware routing's pure parts: block names, the router's prefix index, the load order, the policy, the sim."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.dispatch import CacheAware, InstanceView, ListFleet, make_dispatch
from cluster.load_order import LoadOrder
from cluster.prefix import block_hashes, root_hash
from actors.kv.cache import BlockPool
from cluster.prefix_index import CacheEvents, EventLog, PrefixIndex
from cluster.registry import NoInstanceAvailable, Registry
from cluster.request import RequestStatus
from cluster.stats import EngineStats, LoadStats, SpecDecodingStats, StepStats


def stats(used: int, free: int, running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(LoadStats(running=running, waiting=waiting, kv_blocks_used=used, kv_blocks_free=free),
                       StepStats(num_steps=1, step_time_s=0.01, step_time_ema_s=0.01, batch_size=running,
                                 batch_tokens=running),
                       SpecDecodingStats(policy="off"))


# ---- block names --------------------------------------------------------------------------------------------
def test_blocks_are_named_by_their_whole_prefix_and_only_full_blocks_are_named() -> None:
    root = root_hash("m")
    a = block_hashes(list(range(10)), 4, root)  # two full blocks; the last 2 tokens are not named
    b = block_hashes(list(range(8)) + [99, 98, 97, 96], 4, root)
    c = block_hashes([7] + list(range(1, 12)), 4, root)  # differs in the first token only
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]  # the same 8 leading tokens, the same names
    assert not set(c) & set(a)  # a different first token renames every block after it
    assert block_hashes(list(range(12)), 4, root, known=a) == block_hashes(list(range(12)), 4, root)
    assert block_hashes(list(range(3)), 4, root) == []


def test_the_model_and_a_tenants_salt_keep_chains_apart() -> None:
    tokens = list(range(16))
    names = {tuple(block_hashes(tokens, 4, r)) for r in (root_hash("m"), root_hash("m", "tenant-a"),
                                                         root_hash("m", "tenant-b"), root_hash("other"))}
    assert len(names) == 4
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0, root_hash("m"))


def test_names_are_the_same_in_another_process() -> None:
    """The router, the API replicas and the instances are separate processes: Python's str hash would differ."""
    code = ("from cluster.prefix import block_hashes, root_hash;"
            "print(block_hashes(list(range(40)), 16, root_hash('m', 'salt')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == str(block_hashes(list(range(40)), 16, root_hash("m", "salt")))


# ---- the router's index -------------------------------------------------------------------------------------
def _instance_batches(rng: random.Random, n: int) -> list[CacheEvents]:
    """What an instance with an LRU cache of a few blocks would report over n batches (first one a snapshot)."""
    held: list[int] = []
    batches = []
    for seq in range(1, n + 1):
        stored = [rng.randrange(40) for _ in range(rng.randint(0, 4))]
        stored = [h for h in dict.fromkeys(stored) if h not in held]
        held += stored
        removed = held[: max(0, len(held) - 8)]
        held = held[len(removed):]
        batches.append(CacheEvents(seq, tuple(held) if seq == 1 else tuple(stored), () if seq == 1 else
                                   tuple(removed), snapshot=seq == 1))
    return batches


def test_events_applied_in_any_order_give_the_same_index() -> None:
    rng = random.Random(7)
    streams = {f"i{n}": _instance_batches(rng, 30) for n in range(3)}
    in_order = PrefixIndex()
    for i, batches in streams.items():
        for b in batches:
            in_order.apply(i, b)
    for trial in range(20):
        shuffled = PrefixIndex()
        deliveries = [(i, b) for i, batches in streams.items() for b in batches[1:]]
        random.Random(trial).shuffle(deliveries)
        for i, batches in streams.items():  # the snapshot comes first (an instance's first report)
            shuffled.apply(i, batches[0])
        for i, b in deliveries:
            shuffled.apply(i, b)
        shuffled.apply("i0", streams["i0"][3])  # a duplicate of an applied batch changes nothing
        assert shuffled.snapshot_of() == in_order.snapshot_of()
        assert len(shuffled) == len(in_order) == sum(len(v) for v in in_order.snapshot_of().values())


def test_a_lost_batch_asks_for_a_snapshot_and_a_snapshot_resynchronises() -> None:
    index = PrefixIndex(max_pending=3)
    index.apply("a", CacheEvents(2, (1, 2)))  # never synchronised: nothing applies before a snapshot
    assert "a" in index.needs_snapshot and index.snapshot_of() == {}
    index.apply("a", CacheEvents(1, (1,), snapshot=True))
    assert index.snapshot_of() == {"a": frozenset({1})} and not index.needs_snapshot
    for seq in (3, 4, 5, 6):  # batch 2 never comes
        index.apply("a", CacheEvents(seq, (seq,)))
    assert "a" in index.needs_snapshot and index.snapshot_of() == {"a": frozenset({1})}
    index.apply("a", CacheEvents(7, (5, 6, 7), snapshot=True))
    assert index.snapshot_of() == {"a": frozenset({5, 6, 7})} and not index.needs_snapshot


def test_match_counts_leading_blocks_and_a_dead_instances_entries_go_with_it() -> None:
    root = root_hash("m")
    chain = block_hashes(list(range(40)), 4, root)  # 10 blocks
    index = PrefixIndex()
    index.apply("a", CacheEvents(1, tuple(chain[:7]), snapshot=True))
    index.apply("b", CacheEvents(1, tuple(chain[:3]), snapshot=True))
    index.apply("c", CacheEvents(1, tuple(block_hashes(list(range(1, 41)), 4, root)), snapshot=True))
    assert index.match(chain) == {"a": 7, "b": 3}
    index.drop_instance("a")
    assert index.match(chain) == {"b": 3}
    assert index.holds("a") == frozenset() and len(index) == 3 + 10


def test_routed_blocks_count_until_they_expire_unless_an_event_confirms_them() -> None:
    index = PrefixIndex(provisional_s=5.0)
    index.apply("a", CacheEvents(1, (), snapshot=True))
    index.routed("a", [1, 2, 3], now=0.0)
    assert index.match([1, 2, 3]) == {"a": 3}
    index.apply("a", CacheEvents(2, stored=(1, 2)))  # the instance cached two of them
    assert index.expire(now=4.9) == 0
    assert index.expire(now=5.0) == 1  # block 3 was never reported
    assert index.match([1, 2, 3]) == {"a": 2}


def test_the_index_is_bounded_and_forgets_least_recently_used_tails_first() -> None:
    index = PrefixIndex(max_entries=10)
    chains = [[100 * c + i for i in range(4)] for c in range(4)]  # four chains of 4 blocks
    for n, chain in enumerate(chains):
        index.apply(f"i{n}", CacheEvents(1, tuple(chain), snapshot=True))
        index.match(chains[0])  # chain 0 stays in use
    assert len(index) <= 10
    assert index.match(chains[0]) == {"i0": 4}
    held = index.snapshot_of()
    for instance, hashes in held.items():  # what is left of each chain is a prefix of it
        chain = chains[int(instance[1:])]
        assert hashes == frozenset(chain[: len(hashes)])


def test_an_instances_pool_and_the_index_agree_through_lost_batches_and_a_restarted_router() -> None:
    """The instance side (BlockPool events numbered by EventLog) against the router side (PrefixIndex), pulled in
    order as the router's poll does: a lost batch, a router that starts over, and a pool that dropped its changes
    all end in a snapshot, and the index then holds exactly what the pool holds."""
    rng = random.Random(2)
    pool, log = BlockPool(12, 4), EventLog()
    index = PrefixIndex()
    prompts = [[rng.randrange(5) for _ in range(rng.randint(4, 16))] for _ in range(8)]
    live: list[str] = []
    snapshots = 0
    for n in range(600):
        if rng.random() < 0.5 or not live:  # a request prefills a prompt and names its blocks
            rid, prompt = f"r{n}", rng.choice(prompts)
            pool.match(rid, block_hashes(prompt[:-1], 4, root_hash("m")))
            if pool.reserve(rid, len(prompt)):
                pool.set_length(rid, len(prompt))
                pool.commit(rid, block_hashes(prompt, 4, root_hash("m")))
                live.append(rid)
            else:
                pool.free(rid)
        else:
            pool.free(live.pop(rng.randrange(len(live))))
        if n % 5 == 0:  # the router's poll
            asked = index.wants_snapshot("i")
            events = pool.take_events()
            batch = log.batch(events.stored, events.removed, events.lost, asked, pool.cached_names)
            snapshots += batch.snapshot
            fate = rng.random()
            if fate < 0.05:
                continue  # the answer was lost (the poll timed out)
            if fate < 0.08:
                index = PrefixIndex()  # the router restarted: it knows nothing
            index.apply("i", batch)
            if not index.wants_snapshot("i"):
                assert index.holds("i") == frozenset(pool.cached_names())
        if n == 300:
            pool.max_events = 1  # a pool nobody drained in time drops its changes and says so
    assert snapshots > 3


def test_a_failed_over_request_goes_where_its_tokens_are_cached_never_back_to_the_failed_instance() -> None:
    reg = three_idle_instances()
    chain = block_hashes(list(range(64)), 16, root_hash("m"))
    reg.prefix.apply("a", CacheEvents(1, tuple(chain), snapshot=True))
    reg.prefix.apply("c", CacheEvents(1, tuple(chain[:3]), snapshot=True))
    assert reg.route("r1", 0, now=0.0, model="m", blocks=chain) == "a"
    assert reg.reroute("r1", {"a"}, now=1.0, model="m", blocks=chain) == "c"  # a failed: c holds 3 of its blocks
    assert reg.decisions == {"prefix": 2}
    assert reg.reroute("r1", {"c"}, now=2.0, model="m") in ("a", "b")  # no names: load alone decides
    reg.register("c", "m", "n", now=3.0)  # a replacement under c's id: what c held is forgotten until it reports
    assert "c" not in reg.prefix.match(chain) and reg.prefix.wants_snapshot("c")


# ---- the load order and the policy --------------------------------------------------------------------------
def test_the_load_order_always_gives_the_smallest_current_key() -> None:
    rng = random.Random(3)
    order, keys = LoadOrder(), {}
    for _ in range(3000):
        i = f"i{rng.randrange(30)}"
        if rng.random() < 0.2:
            order.discard(i)
            keys.pop(i, None)
        else:
            keys[i] = (rng.random(), rng.randrange(5), i)
            order.set(i, keys[i])
        assert order.first() == (min(keys, key=keys.get) if keys else None)
        assert len(order) == len(keys)


def test_cache_aware_prefers_the_longest_prefix_unless_it_is_short_or_its_holder_is_overloaded() -> None:
    policy = CacheAware(max_load_gap=0.25, max_request_gap=2, min_match=0.5, blocks_per_request=10)

    def choose(*views: InstanceView, blocks: int = 8) -> str:  # a request of `blocks` full blocks
        return policy.choose(ListFleet(list(views), policy.load_key, blocks))

    light = InstanceView("light", stats(used=10, free=90, running=1), in_flight=1)
    holder = InstanceView("holder", stats(used=30, free=70, running=2), in_flight=2, cached_blocks=6)
    partial = InstanceView("partial", stats(used=20, free=80, running=2), in_flight=2, cached_blocks=2)
    assert choose(light, holder, partial) == "holder"
    hot = InstanceView("holder", stats(used=40, free=60, running=2), in_flight=2, cached_blocks=6)  # 0.4 > 0.1 + 0.25
    assert choose(light, hot, partial, blocks=4) == "partial"  # 2 of 4 blocks: half the prompt
    assert choose(light, hot, partial) == "light"  # 2 of 8: too little to be worth a busier instance
    assert choose(light, holder, blocks=16) == "light"  # 6 of 16 blocks
    edge = InstanceView("holder", stats(used=30, free=70, running=3), in_flight=3, cached_blocks=6)  # 3 = 1 + 2
    assert choose(light, edge) == "holder"
    busy = InstanceView("holder", stats(used=30, free=70, running=4), in_flight=4, cached_blocks=6)  # 4 > 1 + 2
    assert choose(light, busy) == "light"
    assert choose(light, InstanceView("cold", None, 0)) == "cold"


def three_idle_instances() -> Registry:
    """A cache-aware registry of instances a, b and c of model m, each with 10 of 100 blocks used."""
    reg = Registry(make_dispatch("cache_aware"))
    for i in ("a", "b", "c"):
        reg.register(i, "m", "n", now=0.0)
        reg.update(i, stats(used=10, free=90), True, None, now=0.0)
    return reg


def test_the_registry_routes_by_prefix_counts_decisions_and_drops_a_removed_instances_blocks() -> None:
    reg = three_idle_instances()
    chain = block_hashes(list(range(64)), 16, root_hash("m"))
    first = reg.route("r1", 0, now=0.0, model="m", blocks=chain)
    assert reg.decisions == {"load": 1}
    second = reg.route("r2", 0, now=0.1, model="m", blocks=chain)  # r1's blocks count where it went
    assert second == first and reg.decisions["prefix"] == 1
    other = reg.route("r3", 0, now=0.2, model="m", blocks=block_hashes(list(range(1, 65)), 16, root_hash("m")))
    assert other != first  # no prefix in common: least load, and `first` has two in flight
    reg.finish("r1", RequestStatus.FINISHED, now=1.0)
    reg.remove(first, now=1.0)
    assert reg.prefix.match(chain) == {}
    assert reg.route("r4", 0, now=2.0, model="m", blocks=chain) != first
    with pytest.raises(NoInstanceAvailable, match="no instance serves model"):
        reg.route("r5", 0, now=2.0, model="other", blocks=chain)


def test_routes_follow_load_changes_in_every_order() -> None:
    """The registry's indexed least-load answer equals a scan of every instance after any mix of changes."""
    rng = random.Random(11)
    reg = Registry(make_dispatch("least_load"))
    running: list[str] = []
    for n in range(400):
        op = rng.random()
        if op < 0.1 or not reg.instances:
            reg.register(f"i{rng.randrange(12)}", "m", "n", now=n)
        elif op < 0.3:
            i = rng.choice(sorted(reg.instances))
            reg.update(i, stats(rng.randrange(50), 50, running=rng.randrange(3)), rng.random() > 0.1, None, now=n)
        elif op < 0.4:
            reg.set_draining(rng.choice(sorted(reg.instances)), rng.random() < 0.5)
        elif op < 0.45 and len(reg.instances) > 1:
            reg.remove(rng.choice(sorted(reg.instances)), now=1.0)
        elif op < 0.7 and running:
            reg.finish(running.pop(rng.randrange(len(running))), RequestStatus.FINISHED, now=n)
        else:
            views = [e.view() for e in reg.instances.values() if e.accepting]
            expected = min(views, key=reg.policy.load_key).instance_id if views else None
            try:
                got = reg.route(f"r{n}", 0, now=n)
            except NoInstanceAvailable:
                got = None
            assert got == expected
            if got is not None:
                running.append(f"r{n}")


# ---- the simulator ------------------------------------------------------------------------------------------
def test_the_router_simulation_runs_the_real_policies_and_cache_aware_hits_more() -> None:
    from deploy.bench import router_sim

    p = argparse.ArgumentParser()
    router_sim.add_arguments(p)
    args = p.parse_args(["--instances", "20", "--conversations", "300", "--system-prompt-tokens", "64"])
    trace = router_sim.conversations(args.questions, args.conversations, args.system_prompt_tokens,
                                     random.Random(0))
    rows = {policy: router_sim.simulate(args, policy, trace, 0) for policy in ("least_load", "cache_aware")}
    for row in rows.values():
        assert row["requests"] == 600 and row["planning_rounds"] > 0
        assert sum(row["decisions"].values()) == 600
        assert 0 < row["index_entries"] <= args.index_max_entries
    assert rows["cache_aware"]["hit_rate"] > 1.5 * rows["least_load"]["hit_rate"]
    assert rows["cache_aware"]["decisions"].get("prefix", 0) > 250
