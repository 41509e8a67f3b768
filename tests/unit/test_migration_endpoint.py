"""The Endpoint protocol (cluster/migration_endpoint.py) and its messages (cluster/migration_messages.py): one call
that takes a message, held by what implements it (the instance actor the coordinator calls through RayEndpoint,
RayEndpoint itself and the Deadlined wrapper); the instance's handler answers every message type and refuses
anything else; a message checks its fields when it is built; the one deadline wrapper names the message it gave up on."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap

import pytest

from actors.serving.server import InstanceServer
from cluster.migration_endpoint import Deadlined, Endpoint, RayEndpoint, StepTimeout
from cluster.migration_messages import (MESSAGES, Commit, Export, Import, Length, Link, OpenLinks, Pipeline, Release,
                                        Reserve, Side, Stop)
from tests.unit.test_migration_faults import server

METHODS = sorted(name for name, value in vars(Endpoint).items() if inspect.isfunction(value) and name[0] != "_")


def mismatches(cls: type) -> list[str]:
    """How `cls` falls short of Endpoint: each protocol method must be a coroutine function whose parameters begin
    with the protocol's, by name and in order (the coordinator calls them positionally), defaulted where the
    protocol's are; any further parameter must have a default."""
    out = []
    for name in METHODS:
        impl = getattr(cls, name, None)
        if impl is None:
            out.append(f"{name}: missing")
            continue
        if not inspect.iscoroutinefunction(impl):
            out.append(f"{name}: not async")
            continue
        want = list(inspect.signature(getattr(Endpoint, name)).parameters.values())[1:]
        got = list(inspect.signature(impl).parameters.values())[1:]
        if [p.name for p in got[:len(want)]] != [p.name for p in want]:
            out.append(f"{name}: parameters {[p.name for p in got]}, the protocol's {[p.name for p in want]}")
            continue
        kinds = {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}
        out += [f"{name}: {p.name} cannot be passed by position" for p in got[:len(want)] if p.kind not in kinds]
        out += [f"{name}: {g.name} needs a default" for g, w in zip(got, want)
                if w.default is not inspect.Parameter.empty and g.default is inspect.Parameter.empty]
        out += [f"{name}: its extra {p.name} needs a default" for p in got[len(want):]
                if p.default is inspect.Parameter.empty and p.kind in kinds]
    return out


def test_the_protocol_is_one_call_that_takes_a_message() -> None:
    assert METHODS == ["migration"]
    assert {m.__name__ for m in MESSAGES} == {"Length", "Names", "Reserve", "Export", "Import", "Stop", "Commit",
                                              "Release", "Drop", "KVLayout", "LinkAddresses", "OpenLinks",
                                              "CloseChannel"}


@pytest.mark.parametrize("cls", [InstanceServer, RayEndpoint, Deadlined], ids=lambda c: c.__name__)
def test_each_implementation_has_the_endpoint_call_with_a_compatible_signature(cls) -> None:
    assert mismatches(cls) == []


def test_the_check_fails_for_a_missing_or_incompatible_call() -> None:
    class Renamed:
        async def migration(self, message):  # another name: a keyword call would fail
            return message

    class Blocking:
        def migration(self, msg):  # not awaitable
            return msg

    assert mismatches(object) == ["migration: missing"]
    assert [m.split(":")[0] for m in mismatches(Renamed)] == ["migration"]
    assert mismatches(Blocking) == ["migration: not async"]


def handled(cls: type) -> set[str]:
    """The message classes the `case` patterns of `cls.migration` name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.migration)))
    return {node.cls.id for node in ast.walk(tree) if isinstance(node, ast.MatchClass)}


def test_the_instances_handler_answers_every_message_type() -> None:
    assert handled(InstanceServer) == {m.__name__ for m in MESSAGES}


def test_the_instances_handler_refuses_what_is_not_a_message(tiny_models, tiny_draft_models) -> None:
    s = server(tiny_models, tiny_draft_models, "one")
    try:
        for wrong in ("migrate_length", ("Length", "r0"), None):
            with pytest.raises(TypeError, match="not a migration message"):
                asyncio.run(s.migration(wrong))
        assert asyncio.run(s.migration(Length("nobody"))) is None  # a well-formed one is answered
    finally:
        s.shutdown()


@pytest.mark.parametrize(("build", "error", "match"), [
    (lambda: Export("r0", "target", 0, 4), TypeError, "Export.pipeline must be a Pipeline"),
    (lambda: Import("draft", []), TypeError, "Import.pipeline must be a Pipeline"),
    (lambda: Export("r0", Pipeline.TARGET, 5, 4), ValueError, r"Export needs 0 <= start <= end, not \[5, 4\)"),
    (lambda: Export("", Pipeline.DRAFT, 0, 4), ValueError, "Export.request_id must be a non-empty string"),
    (lambda: Reserve("r0", -1, 10.0), ValueError, "Reserve.tokens must be >= 0"),
    (lambda: Reserve("r0", 8, 0.0), ValueError, "Reserve.lease_s must be positive"),
    (lambda: Stop("r0", -2), ValueError, "Stop.start must be >= 0"),
    (lambda: Commit("r0"), TypeError, "Commit.request must be a Request, not str"),
    (lambda: Release(None, True), ValueError, "Release.request_id must be a non-empty string"),
    (lambda: OpenLinks("c", Pipeline.TARGET, (), "src", 5.0, "gloo"), TypeError, "OpenLinks.side must be a Side"),
    (lambda: OpenLinks("c", Pipeline.TARGET, (), Side.SRC, 5.0, "mpi"), ValueError, "backend must be gloo or nccl"),
], ids=["pipeline as a string", "import's pipeline", "range backwards", "no request", "tokens", "lease", "stop",
        "commit", "release", "side as a string", "backend"])
def test_an_ill_formed_message_fails_where_it_is_built_naming_the_field(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()


class Hangs:
    """An end that never answers (a frozen process): what the deadline is for."""

    def __init__(self) -> None:
        self.asked: list[object] = []

    async def migration(self, msg):
        self.asked.append(msg)
        await asyncio.sleep(3600)


def test_the_deadline_wrapper_bounds_every_message_and_names_it() -> None:
    end = Hangs()
    bounded = Deadlined(end, Side.DST, 0.05)
    with pytest.raises(StepTimeout, match=r"the destination's Import did not answer within 0.05 s"):
        asyncio.run(bounded.migration(Import(Pipeline.TARGET, [])))
    with pytest.raises(StepTimeout, match=r"the source's Length did not answer within 0.05 s"):
        asyncio.run(Deadlined(end, Side.SRC, 0.05).migration(Length("r0")))
    assert [type(m).__name__ for m in end.asked] == ["Import", "Length"]


def test_opening_links_is_given_its_own_wait_and_more() -> None:
    """OpenLinks waits up to its `timeout_s` for the other end by itself: its deadline is that plus 5 s, not the
    step's (a step deadline shorter than the open would abort every migration over links)."""
    msg = OpenLinks("c", Pipeline.TARGET, (Link("c/target/0->0", 0, 0, (0,)),), Side.SRC, 0.01, "gloo")
    with pytest.raises(StepTimeout, match=r"OpenLinks did not answer within 5.01 s"):
        asyncio.run(Deadlined(Hangs(), Side.SRC, 0.05).migration(msg))
