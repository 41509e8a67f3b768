"""A group of shard actors called together: every call in flight at once, waited on with a deadline, named on failure.

The one piece every Ray executor is built on (actors/executors/remote.py: pipeline stages and EasySpec draft groups;
actors/executors/experts.py: expert-parallel ranks). Any actor that dies (RayActorError), raises, or does not answer
within `timeout_s` ends the wait at once with a ShardFailure naming it: the group is then out of step and the
instance stops using it.

    group = RankGroup(actors, names, timeout_s=60)
    logits = group.each(lambda a: a.step.remote(ops, chunks, False), "step")[-1]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.executors.protocol import ShardFailure


class RankGroup:
    """Actors in rank order, each with a name for messages (e.g. "stage 1 on l4-0"), and the deadline of a call."""

    def __init__(self, actors: Sequence[ActorHandle], names: Sequence[str], timeout_s: float) -> None:
        if len(actors) != len(names):
            raise ValueError("one name per actor")
        self.actors, self.names = list(actors), list(names)
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return len(self.actors)

    def each(self, call: Callable[[ActorHandle], ray.ObjectRef], what: str,
             timeout_s: float | None = None) -> list:
        """`call` on every actor at once; their results in rank order."""
        return gather([call(a) for a in self.actors], self.names, what, self.timeout_s if timeout_s is None else timeout_s)

    def some(self, ranks: Sequence[int], call: Callable[[int, ActorHandle], ray.ObjectRef], what: str,
             timeout_s: float | None = None) -> list:
        """`call(rank, actor)` on the actors of `ranks` at once; their results in the order of `ranks`."""
        refs = [call(r, self.actors[r]) for r in ranks]
        return gather(refs, [self.names[r] for r in ranks], what, self.timeout_s if timeout_s is None else timeout_s)

    def kill(self, ranks: Sequence[int] | None = None) -> None:
        """Stop the given actors (all by default; after a failure the survivors may be blocked on a dead peer)."""
        for r in range(len(self.actors)) if ranks is None else ranks:
            ray.kill(self.actors[r], no_restart=True)


def gather(refs: list[ray.ObjectRef], names: Sequence[str], what: str, timeout_s: float,
           grace_s: float = 2.0) -> list:
    """Every call's result, in order; ShardFailure naming the actor as soon as one fails, or at the deadline.

    After a first failure the other calls get `grace_s` more to report theirs, so that the message names the
    actor that died (the root cause) rather than a neighbour whose transfer to it failed.
    """
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    failures: list[tuple[bool, str]] = []  # (died, message)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            if failures:
                break
            late = ", ".join(names[index[r]] for r in pending)
            raise ShardFailure(f"{what}: no answer from {late} within {timeout_s:g} s")
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref, timeout=0)
            except RayActorError as e:
                failures.append((True, f"{what}: {names[index[ref]]} died: {_reason(e)}"))
            except (RayError, GetTimeoutError) as e:
                failures.append((False, f"{what}: {names[index[ref]]} failed: {_reason(e)}"))
        if failures and not any(died for died, _ in failures):
            deadline = min(deadline, time.monotonic() + grace_s)
        elif failures:
            break
    if failures:
        raise ShardFailure(next((m for died, m in failures if died), failures[0][1]))
    return results


def _reason(e: Exception) -> str:
    """The original error of a failed remote call, in one line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
