"""Migration policies (cluster/migration_policy.py) with plain data: the right pairs, the right requests, and
invariants over 1,000 randomised rounds (never toward a draining, closed or prefill-only instance, never over
capacity)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cluster.migration_policy import (
    Balance,
    Defrag,
    Drain,
    InstanceLoad,
    MigrationPolicyConfig,
    Planner,
    Queue,
    RequestLoad,
    make_planner,
)

CFG = MigrationPolicyConfig(high_water=0.8, low_water=0.5, priority_headroom_blocks=10, max_per_round=4)


def inst(name, capacity=100, running=(), waiting=(), draining=False, accepting=True, max_running=0):
    reqs = tuple(RequestLoad(f"{name}-r{i}", b, p) for i, (b, p) in enumerate(running))
    queued = tuple(RequestLoad(f"{name}-w{i}", b) for i, b in enumerate(waiting))
    return InstanceLoad(name, capacity, reqs, queued, draining, accepting and not draining, max_running)


def test_balance_moves_the_cheapest_request_from_the_fullest_to_the_emptiest():
    loads = [inst("a", running=[(30, 0), (20, 0), (40, 0)]), inst("b", running=[(10, 0)]),
             inst("c", running=[(30, 0)])]
    [m] = Balance().propose(loads, CFG)
    assert (m.source, m.destination, m.request_id) == ("a", "b", "a-r1")  # 20 blocks: the smallest of a's


def test_balance_prefers_low_priority_and_respects_priority_headroom():
    # a runs a high-priority request: its headroom makes it loaded, and its low-priority request leaves first
    loads = [inst("a", running=[(40, 5), (35, 0)]), inst("b", running=[(10, 0)])]
    [m] = Balance().propose(loads, CFG)
    assert m.request_id == "a-r1"
    # without the headroom a (75/100) is below high water and nothing moves
    assert Balance().propose(loads, CFG.model_copy(update={"priority_headroom_blocks": 0})) == []


def test_balance_does_nothing_when_the_move_would_not_narrow_the_gap():
    loads = [inst("a", running=[(85, 0)]), inst("b", running=[(40, 0)])]
    assert Balance().propose(loads, CFG) == []  # moving 85 blocks to b would make b the fuller one


def test_drain_empties_a_draining_instance_toward_the_most_room_never_toward_another_draining_one():
    loads = [inst("a", running=[(10, 0), (5, 0)], draining=True), inst("b", running=[(60, 0)]),
             inst("c", running=[(20, 0)]), inst("d", draining=True)]
    [m] = Drain().propose(loads, CFG)
    assert (m.source, m.destination, m.request_id) == ("a", "c", "a-r1")
    moves = Planner(cfg=CFG.model_copy(update={"max_per_round": 10})).plan(loads)
    assert all(m.destination not in ("a", "d") for m in moves)


def test_defrag_makes_room_for_a_queue_head_that_fits_nowhere_yet():
    loads = [inst("a", running=[(50, 0), (30, 0)], waiting=[40]), inst("b", running=[(50, 0)])]
    [m] = Defrag().propose(loads, CFG)
    assert (m.source, m.destination, m.request_id) == ("a", "b", "a-r1")  # 30 out: 50 free >= 40 wanted
    assert Defrag().propose([inst("a", running=[(50, 0)], waiting=[40]), inst("b")], CFG) == []  # it fits


def test_queue_sends_the_first_queued_request_that_cannot_start_to_an_idle_instance_with_room():
    # a: 80 of 100 blocks held; its queue head (15) starts next step, the second (30) cannot: it moves
    loads = [inst("a", running=[(50, 0), (30, 0)], waiting=[15, 30, 10]), inst("b", running=[(60, 0)]),
             inst("c", running=[(20, 0)])]
    [m] = Queue().propose(loads, CFG)
    assert (m.source, m.destination, m.request_id, m.reason) == ("a", "c", "a-w1", "queue")
    # a full batch makes the head itself wait, blocks aside
    [m] = Queue().propose([inst("a", running=[(10, 0)], waiting=[5], max_running=1), inst("b")], CFG)
    assert m.request_id == "a-w0"


@pytest.mark.parametrize("destination", [
    inst("b", running=[(90, 0)]),  # no room for 30 blocks
    inst("b", waiting=[5]),  # a queue of its own: the request would wait there too
    inst("b", running=[(1, 0)], max_running=1),  # no batch slot
    inst("b", draining=True),
    inst("b", accepting=False),
], ids=["no room", "own queue", "batch full", "draining", "not accepting"])
def test_queue_never_moves_a_request_where_it_would_not_start_at_once(destination):
    assert Queue().propose([inst("a", running=[(80, 0)], waiting=[30]), destination], CFG) == []


def test_queue_never_moves_a_request_where_growth_would_preempt_it():
    """Room to start is not enough: the destination's requests and the moved one must all fit at their limits."""
    src = InstanceLoad("a", 100, (RequestLoad("a-r0", 90, max_blocks=95),), (RequestLoad("a-w0", 20, max_blocks=40),))
    fits = InstanceLoad("b", 100, (RequestLoad("b-r0", 20, max_blocks=60),))
    grows = InstanceLoad("b", 100, (RequestLoad("b-r0", 20, max_blocks=61),))
    assert [m.request_id for m in Queue().propose([src, fits], CFG)] == ["a-w0"]  # 60 + 40 = 100
    assert Queue().propose([src, grows], CFG) == []  # 61 + 40 > 100, though 80 blocks are free now


def test_queue_leaves_requests_that_start_where_they_are():
    assert Queue().propose([inst("a", running=[(50, 0)], waiting=[20, 20]), inst("b")], CFG) == []


def test_the_planner_counts_a_moved_queued_request_as_started_at_its_destination():
    loads = [inst("a", running=[(90, 0)], waiting=[30, 30]), inst("b", capacity=50), inst("c", capacity=50)]
    moves = Planner([Queue()], CFG).plan(loads)
    # both queued requests start elsewhere in one round (no KV moves, so no pairing limit), one per instance:
    # after the first, b has 20 blocks free, too few for the second
    assert [(m.request_id, m.destination) for m in moves] == [("a-w0", "b"), ("a-w1", "c")]
    moves = Planner([Queue()], CFG).plan([loads[0], inst("b", capacity=50, running=[(30, 0)])])
    assert moves == []  # b's 20 free blocks cannot start a 30-block request


def test_planner_skips_requests_already_migrating_and_pairs_each_instance_once():
    loads = [inst("a", running=[(30, 0), (30, 0), (30, 0)]), inst("b"), inst("c", running=[(45, 0), (45, 0)]),
             inst("d")]
    cfg = CFG.model_copy(update={"high_water": 0.5, "low_water": 0.3})
    moves = Planner(cfg=cfg).plan(loads, migrating=frozenset({"a-r0"}))
    assert len(moves) == 2 and "a-r0" not in {m.request_id for m in moves}
    assert {m.source for m in moves} == {"a", "c"} and {m.destination for m in moves} == {"b", "d"}


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match="unknown migration policies"):
        make_planner(["balance", "teleport"])


def test_randomised_rounds_keep_every_invariant():
    rng = random.Random(0)
    planner = Planner(cfg=CFG.model_copy(update={"max_per_round": 3}))
    for _ in range(1000):
        loads, ids = [], 0
        for i in range(rng.randint(2, 6)):
            cap = rng.choice([50, 100, 200])
            running, used = [], 0
            for _ in range(rng.randint(0, 6)):
                b = rng.randint(1, 40)
                if used + b <= cap:
                    running.append(RequestLoad(f"r{ids}", b, rng.choice([0, 0, 0, 1]),
                                               max_blocks=b + rng.randint(0, 20)))
                    used += b
                    ids += 1
            waiting = []
            for _ in range(rng.randint(0, 2)):
                b = rng.randint(1, 60)
                waiting.append(RequestLoad(f"r{ids}", b, max_blocks=b + rng.randint(0, 20)))
                ids += 1
            draining = rng.random() < 0.2
            loads.append(InstanceLoad(f"i{i}", cap, tuple(running), tuple(waiting), draining,
                                      accepting=not draining and rng.random() < 0.9,
                                      max_running=rng.choice([0, 4]),
                                      role=rng.choice(["both", "both", "both", "prefill", "decode"])))
        migrating = frozenset(r.request_id for x in loads for r in x.running + x.waiting if rng.random() < 0.1)
        moves = planner.plan(loads, migrating)
        # what the planner sees: requests already migrating no longer count at their instance
        by_id = {x.instance_id: replace(x, running=tuple(r for r in x.running if r.request_id not in migrating),
                                        waiting=tuple(r for r in x.waiting if r.request_id not in migrating))
                 for x in loads}
        seen = set()
        for m in moves:  # each checked against the loads as the moves before it left them
            src, dst = by_id[m.source], by_id[m.destination]
            assert m.source != m.destination
            assert dst.accepting and not dst.draining and dst.role != "prefill"
            assert src.role != "prefill" or m.reason in ("drain", "queue")  # its hand-off moves it otherwise
            moved_from = src.waiting if m.reason == "queue" else src.running
            req = next((r for r in moved_from if r.request_id == m.request_id), None)
            assert req is not None and m.request_id not in migrating
            assert m.request_id not in seen
            seen.add(m.request_id)
            assert dst.free_blocks >= m.blocks == req.blocks
            if m.reason == "queue":  # it could not start at its source, and starts at once where it goes
                assert src.stuck() is req and not dst.waiting and dst.has_slot()
                assert dst.peak_blocks() + req.peak_blocks <= dst.capacity_blocks
            if m.reason == "balance":
                h = CFG.priority_headroom_blocks
                assert src.virtual_usage(h) > CFG.high_water and dst.virtual_usage(h) < CFG.low_water
            by_id[m.source] = replace(src, running=tuple(r for r in src.running if r is not req),
                                      waiting=tuple(r for r in src.waiting if r is not req))
            by_id[m.destination] = replace(dst, arriving=dst.arriving + (req,))
        kv_moves = [m for m in moves if m.reason != "queue"]  # each instance in at most one KV-moving migration
        ends = [m.source for m in kv_moves] + [m.destination for m in kv_moves]
        assert len(ends) == len(set(ends))
        # a draining instance with a request that fits somewhere accepting always gets a move planned
        for x in loads:
            if x.draining and any(any(d.accepting and d.decodes and d.free_blocks >= r.blocks for d in loads)
                                  for r in x.running if r.request_id not in migrating):
                assert moves, "a drainable request was left in place"


def test_no_policy_moves_a_request_onto_a_prefill_instance_nor_balances_one_away_from_it():
    # p is prefill-only and the emptiest: without roles Balance, Defrag and Drain would all pick it
    loads = [replace(inst("p", running=[(85, 0)], waiting=[30]), role="prefill"),
             inst("a", running=[(60, 0), (25, 0)], waiting=[40]), inst("b", running=[(70, 0)]),
             replace(inst("e"), role="prefill"), inst("d", running=[(10, 0)], draining=True)]
    moves = Planner(cfg=CFG.model_copy(update={"max_per_round": 10})).plan(loads)
    assert moves, "the decode-capable instances still balance and drain among themselves"
    assert all(m.destination not in ("p", "e") for m in moves)
    assert all(m.source != "p" or m.reason in ("drain", "queue") for m in moves)
    # the same loads with every role `both`: the prefill-only instances are the chosen destinations
    both = Planner(cfg=CFG.model_copy(update={"max_per_round": 10})).plan([replace(x, role="both") for x in loads])
    assert any(m.destination in ("p", "e") for m in both)


def test_queue_moves_a_request_waiting_at_a_prefill_instance_to_an_idle_decode_instance():
    loads = [replace(inst("p", capacity=100, running=[(90, 0)], waiting=[20], max_running=1), role="prefill"),
             replace(inst("q"), role="prefill"), inst("d")]
    [m] = Queue().propose(loads, CFG)
    assert (m.source, m.destination, m.request_id) == ("p", "d", "p-w0")
