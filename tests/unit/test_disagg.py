"""Prefill/decode disaggregation's pure parts: the pair policy on plain data, the config's roles, the router's pair
placement over a real registry and prefix index, and the handoff watcher over plain loads."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import RouterConfig, parse_config
from cluster.disagg import Candidate, DisaggConfig, DisaggPolicy, PromptShape, prefilled
from cluster.dispatch import make_dispatch
from cluster.handoff import Handoffs, avoid_prefill_only, handoff_destination, route_pair
from cluster.migration_policy import InstanceLoad, RequestLoad
from cluster.prefix import block_hashes, root_hash
from cluster.prefix_index import PrefixIndex
from cluster.registry import NoInstanceAvailable, Registry
from cluster.request import RequestStatus
from tests.unit.test_prefix_routing import stats

LONG = PromptShape(tokens=1000, block_size=16)  # 62 full blocks
POLICY = DisaggPolicy(DisaggConfig(skip_prefill_tokens=256))


def c(instance_id: str, role: str, usage: float = 0.0, cached: int = 0, in_flight: int = 0) -> Candidate:
    return Candidate(instance_id, role, usage, in_flight, cached)  # type: ignore[arg-type]


# ---- the pair policy --------------------------------------------------------------------------------------------
def test_a_long_prompt_prefills_on_a_prefill_instance_and_decodes_on_the_least_loaded_decode_instance() -> None:
    fleet = [c("p0", "prefill", 0.5), c("p1", "prefill", 0.1), c("d0", "decode", 0.4), c("d1", "decode", 0.2)]
    got = POLICY.place(fleet, LONG)
    assert (got.first, got.decode, got.reason) == ("p1", "d1", "disaggregated") and got.disaggregated


def test_a_prefix_the_decode_instance_holds_skips_the_prefill_instance() -> None:
    # d0 holds 60 of the 62 blocks: 1000 - 960 = 40 tokens to prefill, under the threshold: d0 prefills them itself
    fleet = [c("p0", "prefill", 0.0), c("d0", "decode", 0.3, cached=60), c("d1", "decode", 0.1)]
    got = POLICY.place(fleet, LONG)
    assert (got.first, got.decode, got.reason) == ("d0", None, "prefix_hit")
    # a shorter hit leaves too much to prefill: split, decoding on the holder
    fleet = [c("p0", "prefill", 0.0), c("d0", "decode", 0.3, cached=10), c("d1", "decode", 0.1)]
    got = POLICY.place(fleet, LONG)
    assert (got.first, got.decode, got.reason) == ("p0", "d0", "disaggregated")


def test_a_holder_too_loaded_next_to_the_least_loaded_loses_to_load() -> None:
    fleet = [c("p0", "prefill", 0.0), c("d0", "decode", 0.9, cached=60), c("d1", "decode", 0.1)]
    got = POLICY.place(fleet, LONG)
    assert (got.first, got.decode) == ("p0", "d1")


def test_a_short_prompt_runs_on_its_decode_instance_alone() -> None:
    got = POLICY.place([c("p0", "prefill"), c("d0", "decode")], PromptShape(tokens=100, block_size=16))
    assert (got.first, got.decode, got.reason) == ("d0", None, "short_prompt")
    # the threshold at 0: every request is split
    got = DisaggPolicy(DisaggConfig(skip_prefill_tokens=0)).place([c("p0", "prefill"), c("d0", "decode")],
                                                                 PromptShape(tokens=5, block_size=16))
    assert (got.first, got.decode) == ("p0", "d0")


def test_a_missing_role_falls_back_to_aggregated() -> None:
    got = POLICY.place([c("p0", "prefill", 0.5), c("p1", "prefill", 0.2)], LONG)
    assert (got.first, got.decode, got.reason) == ("p1", None, "no_decode_instance")
    got = POLICY.place([c("d0", "decode", 0.5), c("d1", "decode", 0.2)], LONG)
    assert (got.first, got.decode, got.reason) == ("d1", None, "no_prefill_instance")
    got = POLICY.place([c("p0", "prefill"), c("d0", "decode")], None)  # no prompt shape: not split
    assert (got.first, got.decode, got.reason) == ("d0", None, "no_prompt_shape")
    with pytest.raises(ValueError):
        POLICY.place([], LONG)


def test_both_instances_serve_either_side_and_a_pair_is_never_one_instance() -> None:
    got = POLICY.place([c("b0", "both", 0.0), c("d0", "decode", 0.5)], LONG)
    assert (got.first, got.decode) == ("b0", None) and got.reason == "same_instance"
    got = POLICY.place([c("b0", "both", 0.6), c("p0", "prefill", 0.1), c("d0", "decode", 0.7)], LONG)
    assert (got.first, got.decode) == ("p0", "b0")


def test_random_fleets_keep_the_pairs_invariants() -> None:
    """1,000 random fleets: the first instance prefills, the decode instance decodes, the two differ, and a split
    request really has more than the threshold to prefill at its decode instance."""
    rng = random.Random(0)
    for _ in range(1000):
        fleet = [c(f"i{n}", rng.choice(("prefill", "decode", "both")), rng.random(), cached=rng.randint(0, 62),
                   in_flight=rng.randint(0, 5)) for n in range(rng.randint(1, 8))]
        got = POLICY.place(fleet, LONG)
        by_id = {x.instance_id: x for x in fleet}
        if got.decode is None:
            continue
        assert got.first != got.decode
        assert by_id[got.first].prefills and by_id[got.decode].decodes
        assert LONG.tokens - by_id[got.decode].cached_blocks * LONG.block_size >= POLICY.cfg.skip_prefill_tokens
        decoders = [x for x in fleet if x.decodes]
        least = min(decoders, key=lambda x: (x.usage, x.in_flight, x.instance_id))
        assert by_id[got.decode].usage <= least.usage + POLICY.cfg.max_load_gap


def test_the_decode_instance_of_a_handoff_leaves_out_the_source() -> None:
    fleet = [c("p0", "prefill"), c("d0", "decode", 0.1), c("b0", "both", 0.5)]
    assert POLICY.decode_instance(fleet, exclude=frozenset({"d0"})) == "b0"
    assert POLICY.decode_instance([c("p0", "prefill")]) is None


def test_prefilled_means_a_token_beyond_the_prompt() -> None:
    assert not prefilled(10, 10) and prefilled(10, 11)


# ---- the config ---------------------------------------------------------------------------------------------------
def with_roles(instances: int, roles: list[str]):
    """A config of `instances` instances with these roles (the count is the fleet's, the roles the router's)."""
    return parse_config({"engine": {"model": {"target": "m"}}, "fleet": {"instances": instances},
                         "router": {"disaggregation": {"roles": roles}}})


def test_roles_are_one_per_instance_and_some_instance_decodes() -> None:
    cfg = with_roles(3, ["prefill", "decode", "both"]).router
    assert cfg.disaggregation.enabled and cfg.disaggregation.role_of(0) == "prefill"
    assert not RouterConfig().disaggregation.enabled and RouterConfig().disaggregation.role_of(4) == "both"
    with pytest.raises(ValueError, match="one role per instance"):
        with_roles(3, ["prefill", "decode"])
    with pytest.raises(ValueError, match="none decodes"):
        with_roles(2, ["prefill", "prefill"])
    with pytest.raises(ValueError, match="roles"):
        with_roles(1, ["decoder"])


# ---- placement over the router's registry ------------------------------------------------------------------------
def registry() -> Registry:
    reg = Registry(make_dispatch("least_load"), prefix=PrefixIndex())
    for i in ("p0", "d0", "d1"):
        reg.register(i, "m", "node", 0.0)
        reg.update(i, stats(used=10, free=90), True, None, 0.0)
    return reg


ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}


def test_route_pair_records_the_request_where_it_prefills_and_uses_the_prefix_index() -> None:
    reg = registry()
    tokens = list(range(1000))
    blocks = block_hashes(tokens, 16, root_hash("m"))
    got = route_pair(reg, POLICY, ROLES, "r1", 0, 1.0, "m", blocks, PromptShape(len(tokens), 16))
    assert (got.first, got.reason) == ("p0", "disaggregated") and got.decode in ("d0", "d1")
    assert reg.requests["r1"].instance_id == "p0" and "r1" in reg.instances["p0"].in_flight
    # d1 now holds the whole prefix (its events said so): the same prompt skips the prefill instance
    reg.prefix.routed("d1", blocks, 1.0)
    got = route_pair(reg, POLICY, ROLES, "r2", 0, 1.0, "m", blocks, PromptShape(len(tokens), 16))
    assert (got.first, got.decode, got.reason) == ("d1", None, "prefix_hit")
    reg.finish("r1", RequestStatus.FINISHED, 2.0)
    reg.finish("r2", RequestStatus.FINISHED, 2.0)
    assert reg.pending() == 0


def test_route_pair_leaves_out_draining_instances_and_says_why_when_none_is_left() -> None:
    reg = registry()
    reg.set_draining("d0")
    reg.set_draining("d1")
    got = route_pair(reg, POLICY, ROLES, "r1", 0, 1.0, "m", (), LONG)
    assert (got.first, got.decode, got.reason) == ("p0", None, "no_decode_instance")
    reg.set_draining("p0")
    with pytest.raises(NoInstanceAvailable, match="draining"):
        route_pair(reg, POLICY, ROLES, "r2", 0, 1.0, "m", (), LONG)


def test_a_handoff_goes_to_another_decode_instance_if_its_own_left_and_nowhere_if_none_is_left() -> None:
    reg = registry()
    route_pair(reg, POLICY, ROLES, "r1", 0, 1.0, "m", (), LONG)
    assert handoff_destination(reg, POLICY, ROLES, "r1", "d0") == "d0"
    reg.set_draining("d0")
    assert handoff_destination(reg, POLICY, ROLES, "r1", "d0") == "d1"
    reg.remove("d1", 2.0)
    assert handoff_destination(reg, POLICY, ROLES, "r1", "d0") is None  # it finishes where it is
    reg.finish("r1", RequestStatus.FINISHED, 3.0)
    assert handoff_destination(reg, POLICY, ROLES, "r1", "d0") is None and reg.pending() == 0


def test_a_failover_avoids_prefill_instances_while_another_decodes() -> None:
    reg = registry()
    assert avoid_prefill_only(reg, ROLES, "m", {"d0"}) == {"d0", "p0"}  # d1 decodes: it resumes there
    assert avoid_prefill_only(reg, ROLES, "m", {"d0", "d1"}) == {"d0", "d1"}  # only p0 is left: better than none
    assert avoid_prefill_only(reg, {}, "m", {"d0"}) == {"d0"}  # no roles: as before
    assert reg.reroute("r1", avoid_prefill_only(reg, ROLES, "m", {"d0"}), 1.0, "m") == "d1"


# ---- the handoff watcher --------------------------------------------------------------------------------------------
class Fake:
    """Plain per-request loads as an instance would report them, and the moves asked for."""

    def __init__(self) -> None:
        self.loads: dict[str, InstanceLoad] = {}
        self.moved: list[tuple[str, str]] = []

    async def load(self, instance_id: str) -> InstanceLoad:
        if instance_id not in self.loads:
            raise TimeoutError(instance_id)
        return self.loads[instance_id]

    async def move(self, request_id: str, destination: str) -> None:
        self.moved.append((request_id, destination))


def at(instance_id: str, running: dict[str, int] = {}, waiting: dict[str, int] = {}) -> InstanceLoad:  # noqa: B006
    return InstanceLoad(instance_id, 100, tuple(RequestLoad(r, 1, tokens=t) for r, t in running.items()),
                        tuple(RequestLoad(r, 1, tokens=t) for r, t in waiting.items()))


def test_a_request_is_handed_off_once_its_first_token_is_out_and_only_then() -> None:
    async def run() -> None:
        fake = Fake()
        h = Handoffs(0.01, fake.load, fake.move, lost_after_s=60.0)
        h.add("a", "p0", "d0", prompt_tokens=100)
        h.add("b", "p0", "d1", prompt_tokens=50)
        h.add("gone", "p0", "d0", prompt_tokens=10)
        fake.loads["p0"] = at("p0", waiting={"a": 100, "gone": 10}, running={"b": 50})  # queued / prefilling
        assert await h.round() == [] and h.pending.keys() == {"a", "b", "gone"}
        fake.loads["p0"] = at("p0", running={"a": 101, "b": 50})  # a's first token; "gone" ended there
        assert await h.round() == ["a"]
        await asyncio.sleep(0)
        assert fake.moved == [("a", "d0")] and h.pending.keys() == {"b"} and h.dropped == 1
        fake.loads.pop("p0")  # the instance does not answer: nothing is decided
        assert await h.round() == [] and h.pending.keys() == {"b"}
        h.drop("b")
        assert not h.pending and h.waiting_at("p0") == 0
        await h.close()
    asyncio.run(run())


def test_a_handoff_never_seen_is_dropped_after_the_grace() -> None:
    async def run() -> None:
        fake = Fake()
        h = Handoffs(0.01, fake.load, fake.move, lost_after_s=0.0)
        fake.loads["p0"] = at("p0")
        h.add("never", "p0", "d0", prompt_tokens=10)
        await asyncio.sleep(0.01)
        assert await h.round() == [] and not h.pending and not fake.moved
        h.add("stuck", "gone", "d0", prompt_tokens=10)  # its prefill instance never answers: dropped after the grace
        await asyncio.sleep(0.01)
        assert await h.round() == [] and not h.pending and h.dropped == 2
    asyncio.run(run())
