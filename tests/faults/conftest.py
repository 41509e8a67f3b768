"""The fault tier: a Ray cluster whose workers are hosts of their own (network namespaces on a private bridge, made and
removed here; loopback where they cannot be made, said in one line), the app served on it, and its tiny models.

The hosts live for this package's tests only (they run before the session's loopback cluster starts: neither uses
the other); each module deploys the app it needs and deletes it at its end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.bench.fault_kit import App, Hosts, LoadRun
from deploy.bench.faults import Outcome, apps
from tests.fixtures.tiny_models import DRAFT_NOISE, build_tiny_model, perturbed_copy
from tests.unit.helpers import load, text_prompts

CONTEXT = 1024
TOKENS = 200  # per stream; a fault lands after each stream's first 8 chunks (an event, not a delay)
STREAMS = 3


@pytest.fixture(scope="package")
def fault_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fault-models")
    target = build_tiny_model("llama", root / "target", max_position_embeddings=CONTEXT)
    return target, perturbed_copy(target, root / "draft", DRAFT_NOISE)


@pytest.fixture(scope="package")
def hosts(tmp_path_factory) -> Iterator[Hosts]:
    h = Hosts(tmp_path_factory.mktemp("fault-hosts"))
    try:
        h.start()
        print(f"\n{h.note}")
        yield h
    finally:
        h.close()


class Served:
    """A deployed app with its prompts and the unfaulted run of them (the reference outputs and gaps)."""

    def __init__(self, app: App, prompts: list[list[int]]) -> None:
        self.app, self.prompts = app, prompts
        self.baseline: LoadRun = asyncio.run(app.load(prompts, TOKENS))
        assert all(s.error is None and s.finish == "length" for s in self.baseline.streams), self.baseline


def serve(hosts: Hosts, fault_models, name: str, offset: int, wait_s: float = 300.0,
          start_delay_s: float = 0.0) -> Iterator[Served]:
    """App `name` deployed, its failover wait's floor `wait_s`, every instance start `start_delay_s` slower."""
    target, draft = fault_models
    app = hosts.deploy(apps(target, draft, wait_s=wait_s)[name], target, start_delay_s=start_delay_s)
    try:
        yield Served(app, text_prompts(load(target), STREAMS, offset=offset))
    finally:
        hosts.delete_app()


def assert_survived(outcome: Outcome) -> None:
    """What every fault must leave: every stream it aims at hit mid-stream (the instances are paused between two
    steps while it is injected: run_fault(hold=True)), none lost, none changed, the service answering again,
    nothing leaked (router table, pending count, KV blocks on every instance). The survival checks cover every
    stream, hit or not."""
    assert outcome.hits >= 1 and outcome.in_flight == outcome.hits, \
        f"the fault did not strike every stream it aims at mid-stream: {outcome}"
    assert outcome.lost == 0 and outcome.changed == 0, outcome
    assert outcome.served_again_s is not None, outcome
    assert (outcome.leaked_requests, outcome.leaked_pending, outcome.leaked_blocks) == (0, 0, 0), outcome
