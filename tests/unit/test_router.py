"""The router's pure parts: dispatch policies and the registry (instances, request table, draining, failures)."""

from __future__ import annotations

import pytest

from cluster.dispatch import InstanceView, LeastLoad, ListFleet, RoundRobin, make_dispatch
from cluster.registry import NoInstanceAvailable, Registry, RequestStatus
from cluster.stats import EngineStats, LoadStats, SpecDecodingStats, StepStats


def stats(used: int, free: int, running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(LoadStats(running=running, waiting=waiting, kv_blocks_used=used, kv_blocks_free=free),
                       StepStats(num_steps=1, step_time_s=0.01, step_time_ema_s=0.01, batch_size=running,
                                 batch_tokens=running),
                       SpecDecodingStats(policy="fixed"))


def test_least_load_picks_the_lowest_virtual_usage_counting_queued_demand() -> None:
    policy = LeastLoad(blocks_per_request=10)
    a = InstanceView("a", stats(used=50, free=50, running=2), in_flight=2)  # 0.5
    a_queued = InstanceView("a", stats(used=50, free=50), in_flight=2)  # two routed, not yet seen: (50 + 20)/100
    b = InstanceView("b", stats(used=10, free=90, running=1, waiting=5), in_flight=6)  # (10 + 5*10)/100 = 0.6
    c = InstanceView("c", stats(used=0, free=100), in_flight=0, draining=True)  # inf
    assert policy.choose(ListFleet([a, b, c], policy.load_key)) == "a"
    assert policy.choose(ListFleet([a_queued, b, c], policy.load_key)) == "b"
    d = InstanceView("d", stats(used=55, free=45, running=1), in_flight=1)
    assert policy.choose(ListFleet([b, d], policy.load_key)) == "d"  # 0.55 < 0.6
    # an instance without stats yet is judged by its requests in flight
    x, y = InstanceView("x", None, in_flight=3), InstanceView("y", None, in_flight=1)
    assert policy.choose(ListFleet([x, y], policy.load_key)) == "y"


def test_round_robin_cycles_and_skips_draining_instances() -> None:
    policy = RoundRobin()
    views = [InstanceView(i, None, 0) for i in "abc"]
    assert [policy.choose(ListFleet(views, policy.load_key)) for _ in range(6)] == list("abcabc")
    views[1] = InstanceView("b", None, 0, draining=True)
    assert {policy.choose(ListFleet(views, policy.load_key)) for _ in range(4)} == {"a", "c"}
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        make_dispatch("random")


def test_registry_routes_balances_finishes_and_frees_the_slot() -> None:
    reg = Registry(make_dispatch("least_load"))
    with pytest.raises(NoInstanceAvailable, match="no instance is registered"):
        reg.route("r0", 0, now=0.0)
    reg.register("i0", "m", "n0", now=0.0)
    reg.register("i1", "m", "n1", now=0.0)
    placed = [reg.route(f"r{i}", 0, now=1.0) for i in range(4)]
    assert sorted(placed) == ["i0", "i0", "i1", "i1"]  # no stats: balanced by requests in flight
    assert reg.pending() == 4
    with pytest.raises(ValueError, match="already running"):
        reg.route("r0", 0, now=1.0)
    reg.finish("r0", RequestStatus.FINISHED, now=2.0)
    assert reg.pending() == 3 and reg.requests["r0"].status == RequestStatus.FINISHED
    reg.finish("r0", RequestStatus.ABORTED, now=3.0)  # a second end changes nothing
    assert reg.requests["r0"].status == RequestStatus.FINISHED
    with pytest.raises(NoInstanceAvailable, match="no instance serves model"):
        reg.route("r9", 0, now=1.0, model="other")


def test_draining_and_unhealthy_instances_get_no_new_requests() -> None:
    reg = Registry(make_dispatch("round_robin"))
    reg.register("i0", "m", "n0", now=0.0)
    reg.register("i1", "m", "n1", now=0.0)
    reg.set_draining("i0")
    assert {reg.route(f"r{i}", 0, now=0.0) for i in range(3)} == {"i1"}
    failed = reg.mark_unhealthy("i1", "stage 1 died")
    assert failed == ["r0", "r1", "r2"]
    with pytest.raises(NoInstanceAvailable, match="every healthy instance is draining"):
        reg.route("r3", 0, now=0.0)
    reg.set_draining("i0", False)
    assert reg.route("r3", 0, now=0.0) == "i0"
    reg.mark_unhealthy("i0", "loop stopped")
    with pytest.raises(NoInstanceAvailable, match="every instance is unhealthy: i0: loop stopped; i1: stage 1 died"):
        reg.route("r4", 0, now=0.0)


def test_the_request_table_keeps_a_bounded_history_of_finished_requests() -> None:
    reg = Registry(make_dispatch("least_load"), keep_finished=3)
    reg.register("i0", "m", "n0", now=0.0)
    for i in range(6):
        reg.route(f"r{i}", 0, now=float(i))
        reg.finish(f"r{i}", RequestStatus.FINISHED, now=float(i))
    reg.route("live", 5, now=7.0)
    assert sorted(reg.requests) == ["live", "r3", "r4", "r5"]
    assert reg.requests["live"].row().priority == 5


def test_re_registration_keeps_the_requests_in_flight() -> None:
    reg = Registry(make_dispatch("least_load"))
    reg.register("i0", "m", "n0", now=0.0)
    reg.route("r0", 0, now=0.0)
    reg.register("i0", "m", "n0", now=5.0)  # e.g. after a health check found the router had dropped it
    assert reg.pending() == 1
    reg.update("i0", stats(3, 97, running=1), healthy=True, error=None, now=6.0)
    assert reg.instances["i0"].row().stats.load.kv_blocks_used == 3


def test_an_instance_row_says_which_path_its_model_runs_on() -> None:
    reg = Registry(make_dispatch("least_load"))
    reg.register("i0", "m", "n0", now=0.0, backend="generic path (transformers' gemma3_text decoder layers)")
    reg.register("i1", "m", "n1", now=0.0)  # an instance of an older build says nothing
    rows = {i: e.row() for i, e in reg.instances.items()}
    assert rows["i0"].backend.startswith("generic path (transformers' gemma3_text") and rows["i1"].backend == ""


def test_reconcile_closes_what_the_instance_no_longer_holds_with_the_instances_status() -> None:
    reg = Registry(make_dispatch("round_robin"))
    reg.register("i0", "m", "n0", now=0.0)
    for rid in ("done", "cut", "broke", "live", "lost", "young"):
        reg.route(rid, 0, now=0.0 if rid != "young" else 9.0)
    asked = sorted(reg.instances["i0"].in_flight)
    reg.route("later", 0, now=9.5)  # routed after the poll asked: not judged by this answer
    states = {"done": RequestStatus.FINISHED, "cut": RequestStatus.ABORTED, "broke": RequestStatus.FAILED,
              "live": RequestStatus.RUNNING}
    assert [r.request_id for r in reg.reconcile("i0", asked, states, now=10.0, grace_s=5.0)] == ["lost"]
    assert reg.pending() == 6  # an end the instance reports gets one poll for the API's own release to arrive
    closed = reg.reconcile("i0", asked, states, now=10.0, grace_s=5.0)
    assert {(r.request_id, r.status, r.seen_by_instance) for r in closed} == {
        ("done", RequestStatus.FINISHED, True), ("cut", RequestStatus.ABORTED, True),
        ("broke", RequestStatus.FAILED, True)}
    assert reg.instances["i0"].in_flight == {"live", "young", "later"} and reg.pending() == 3
    assert reg.requests["done"].status == RequestStatus.FINISHED and reg.requests["lost"].finished_at == 10.0
    # the API's own release arriving afterwards changes nothing; a young unknown request closes after the grace
    reg.finish("cut", RequestStatus.FINISHED, now=11.0)
    assert reg.requests["cut"].status == RequestStatus.ABORTED
    closed = reg.reconcile("i0", ["live", "young"], {"live": RequestStatus.RUNNING}, now=14.5, grace_s=5.0)
    assert [r.request_id for r in closed] == ["young"] and reg.pending() == 2
    assert reg.reconcile("gone", ["x"], {}, now=20.0, grace_s=5.0) == []


def test_reconcile_leaves_a_migrating_request_alone() -> None:
    """A source lets go of a migrating request before the router rehomes it; a poll answered in between must not
    close it (it did: streams of requests older than the grace ended early under the migration policies)."""
    reg = Registry(make_dispatch("round_robin"))
    reg.register("i0", "m", "n0", now=0.0)
    reg.route("moving", 0, now=0.0)
    assert reg.reconcile("i0", ["moving"], {}, now=60.0, grace_s=30.0, moving={"moving"}) == []
    assert reg.requests["moving"].status == RequestStatus.RUNNING
    [closed] = reg.reconcile("i0", ["moving"], {}, now=60.0, grace_s=30.0)  # not migrating: an orphan
    assert closed.status == RequestStatus.ABORTED


def test_removing_an_instance_closes_the_requests_still_running_there() -> None:
    """Issue 24: `remove` left the removed instance's RUNNING rows behind, which no poll ever visits again (each
    poll asks the instances it knows), so they stayed running in the table forever."""
    reg = Registry(make_dispatch("round_robin"))
    reg.register("i0", "m", "n0", now=0.0)
    reg.register("i1", "m", "n1", now=0.0)
    for rid in ("a", "b", "c"):
        reg.route(rid, 0, now=1.0)
    on_i0 = sorted(reg.instances["i0"].in_flight)

    reg.remove("i0", now=2.0)

    assert {rid: reg.requests[rid].status for rid in on_i0} == {rid: RequestStatus.FAILED for rid in on_i0}
    assert all(reg.requests[rid].finished_at == 2.0 for rid in on_i0)
    assert [r.request_id for r in reg.requests.values() if r.status == RequestStatus.RUNNING] == \
        sorted(reg.instances["i1"].in_flight)
    # a closed request that fails over runs again where it resumes
    assert reg.reroute(on_i0[0], {"i0"}, now=3.0) == "i1" and reg.requests[on_i0[0]].status == RequestStatus.RUNNING


def test_a_router_that_never_saw_a_request_adopts_it_on_failover_and_from_its_instance() -> None:
    """After a router restart the table is rebuilt from what instances report (`adopt`); a request whose instance
    died before that is unknown, and its failover records it where it resumes instead of failing."""
    reg = Registry(make_dispatch("least_load"))
    reg.register("i0", "m", "n0", now=0.0, incarnation="actor-0")
    reg.adopt("held", "i0", priority=2, now=0.0)
    assert reg.requests["held"].priority == 2 and reg.instances["i0"].in_flight == {"held"}
    assert reg.reroute("unknown", {"gone"}, now=1.0, priority=1) == "i0"
    assert reg.requests["unknown"].status == RequestStatus.RUNNING and reg.pending() == 2
    # a replacement under the same id (another incarnation) keeps counting what was routed to the one it replaced
    reg.register("i0", "m", "n0", now=2.0, incarnation="actor-1")
    assert reg.instances["i0"].incarnation == "actor-1" and reg.pending() == 2
