"""Faults of an app with two single-stage instances on two workers (the third spare): an instance killed, a link cut
and restored, a link slow and lossy, a migration's destination killed mid-copy. Streams fail over to the instance
left, resume from their tokens, and give the unfaulted text."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from deploy.bench.faults import BY_NAME, node_address, run_fault
from tests.faults.conftest import TOKENS, Served, assert_survived, serve


@pytest.fixture(scope="module")
def two(hosts, fault_models) -> Iterator[Served]:
    yield from serve(hosts, fault_models, "two", offset=9)


def fault(two: Served, name: str):
    return asyncio.run(run_fault(BY_NAME[name], two.app, two.prompts, TOKENS, two.baseline, hold=True))


def test_one_of_two_instances_killed_its_streams_fail_over_to_the_other(two) -> None:
    assert_survived(fault(two, "instance_killed_of_two"))


def test_a_link_cut_then_restored_loses_no_stream_and_the_node_back_at_a_new_address_is_used_again(two) -> None:
    """The cut lasts until Ray has given the node up and the router has taken the instance out (observed states, not
    a duration); its streams fail over and give the unfaulted text. The node comes back at another address, like a
    KubeRay pod that replaces an evicted one, and the instance's replacement, with no room elsewhere, runs on it:
    nothing is pinned by address (issue 24: a pod pinned by `node:<ip>` was never used again)."""
    [inst1] = [r for r in two.app.instances() if r["instance_id"] == "inst-1"]
    held = {s["node"] for s in inst1["place"]["stages"]} | {inst1["place"]["draft"]["node"]}
    assert len(held) == 2  # the premise: instance 1 holds the two other workers, so inst-0 has nowhere else to go
    outcome = fault(two, "link_cut")
    assert_survived(outcome)
    worker, address, victim = re.match(r"cut w(\d+) at (\S+) \((inst-\d+)\)", outcome.note).groups()
    assert two.app.worker_of(victim) == int(worker)
    if two.app.hosts.fabric is not None:
        assert node_address(int(worker)) != address


def test_a_slow_lossy_link_slows_streams_and_changes_nothing(two) -> None:
    if two.app.hosts.fabric is None:
        pytest.skip(two.app.hosts.note)  # loopback has no link of a node's own to degrade
    outcome = fault(two, "link_degraded")
    assert_survived(outcome)
    assert "w" in outcome.note


def test_a_migration_whose_destination_dies_mid_copy_leaves_the_request_running_at_its_source(two) -> None:
    """The fault aims at the migrated request, which must be mid-stream when its destination dies; the other streams
    (the destination's fail over, if it still runs any) must end unharmed all the same."""
    outcome = fault(two, "migration_destination_killed")
    assert outcome.hits == 1, outcome
    assert_survived(outcome)
    assert outcome.note.startswith("migration aborted_dst"), outcome.note
