"""The Endpoint protocol (cluster/migration_endpoint.py) holds for what implements it: the instance actor the
coordinator calls through RayEndpoint, RayEndpoint itself and the Deadlined wrapper. RayEndpoint names each method,
so a method the instance lacks or takes other arguments to fails here, not mid-migration on a cluster."""

from __future__ import annotations

import inspect

import pytest

from actors.serving.server import InstanceServer
from cluster.migration_endpoint import Deadlined, Endpoint, RayEndpoint

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


def test_the_protocol_has_the_calls_of_a_migration() -> None:
    assert {"migrate_length", "migrate_export", "migrate_stop", "migrate_commit", "migrate_release",
            "links_open", "channel_close"} <= set(METHODS) and len(METHODS) == 17


@pytest.mark.parametrize("cls", [InstanceServer, RayEndpoint, Deadlined], ids=lambda c: c.__name__)
def test_each_implementation_has_every_endpoint_method_with_a_compatible_signature(cls) -> None:
    assert mismatches(cls) == []


def test_the_check_fails_for_a_missing_or_incompatible_method() -> None:
    class Lacking(RayEndpoint):
        migrate_drop = None

        async def migrate_names(self, rid: str):  # another name: a keyword call would fail
            return rid

        async def migrate_length(self, request_id: str, extra: int):  # a parameter the coordinator never passes
            return request_id, extra

        def channel_close(self, channel: str):  # not awaitable
            return channel

    assert sorted(m.split(":")[0] for m in mismatches(Lacking)) == ["channel_close", "migrate_drop",
                                                                     "migrate_length", "migrate_names"]
