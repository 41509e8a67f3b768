"""Live migration of one running request between instances, staged as in Llumnix (Sun et al., OSDI '24, arXiv 2406.03243).

    result = await migrate(request_id, source, destination, MigrationConfig())

Handshake: the destination reserves KV blocks for what the request holds now, or refuses; with prefix caching it
starts the request with the full blocks its cache already holds under the same names (the source sends the names
of the request's blocks), and the copy starts after them (docs/prefix_caching.md). Stages: copy the
request's target KV produced so far while the source keeps decoding (in chunks of at most `chunk_tokens`, each
between two of the source's steps, so that no copy stalls its decoding for long); copy again what it produced
meanwhile;
once what is left is at most `stop_copy_tokens` (or after `max_stages`), stop the request at the source, copy
the rest (the only downtime), commit at the destination (the request resumes there with its tokens, streamed
text, sampler state and stats), and release it at the source (its KV freed, its stream told where it went).
The draft's KV moves in chunks beside the target's, the rest just before the stop (`draft_kv: move`), or the
destination's draft rebuilds it by catching up on its first drafting round (`draft_kv: rebuild`,
actors/speculation/drafters.py). Any failure before the
commit leaves the request running at the source, nothing lost, and frees what the destination reserved.

An `Endpoint` is an instance as the coordinator sees it: one call, `migration(msg)`, that takes a message of
cluster/migration_messages.py; actors/serving/server.py implements it as a Ray method (wrapped by `RayEndpoint`),
tests with engines in this process. Each stage below is a function that returns a `StageStatus` (RUNNING: the next
stage follows), as Llumnix's migration coordinator returns its MigrationStatus from each stage:

    probe -> handshake -> copy_stage (x up to max_stages) -> stop_and_commit -> release

The KV travels as an opaque payload (KV exports, or the headers of what went over the migration's links) with
the token position it reaches: the coordinator only sequences the messages, so it lives beside the router that
runs it and imports nothing from actors/.

**Links** (`transfer: torch`): the KV goes stage to stage, from the process that holds a source stage's cache
to the one that holds each destination stage whose layers overlap it (a shard actor, or the instance's own
process for stages it runs itself), over one two-rank torch.distributed group per such pair (`plan_links`):
an instance's engine process never holds another instance's KV on the way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from cluster.config import MigrationConfig
from cluster.migration_endpoint import Deadlined, Endpoint, RayEndpoint, StepTimeout
from cluster.migration_messages import (BlockNames, CloseChannel, Commit, Drop, Export, Import, KVLayout, Length, Link,
                                        LinkAddresses, Names, OpenLinks, Pipeline, Release, Reservation, Reserve,
                                        Side, Stop)

__all__ = ["BlockNames", "Deadlined", "Endpoint", "Link", "MigrationProgress", "MigrationResult", "MigrationRun",
           "MigrationStatus", "RayEndpoint", "Reservation", "StageStatus", "StepTimeout", "channel_backend",
           "copy_stage", "handshake", "migrate", "plan_links", "probe", "release", "stop_and_commit"]

log = logging.getLogger(__name__)


class MigrationStatus(str, enum.Enum):
    FINISHED = "finished"  # committed at the destination, released at the source
    ABORTED_SRC = "aborted_src"  # the source could not go on (request ended there first, source failed)
    ABORTED_DST = "aborted_dst"  # the destination refused or failed; the request runs on at the source


@dataclass(frozen=True)
class MigrationProgress:
    """Where a migration under way stands (the router shows it; fault tests wait on it)."""

    request_id: str
    phase: str  # "reserved", "copying" (a chunk landed), "stopped", "committed"
    stages: int
    tokens_copied: int


@dataclass(frozen=True)
class MigrationResult:
    request_id: str
    status: MigrationStatus
    reason: str = ""
    stages: int = 0  # copies made while the source kept decoding
    tokens_copied: int = 0  # target KV tokens moved, all stages
    tokens_skipped: int = 0  # target KV tokens not moved: the destination's prefix cache held them
    bytes_copied: int = 0  # of target KV moved (every layer, K and V)
    bytes_skipped: int = 0
    downtime_s: float = 0.0  # from the request's stop at the source (its last step there done) to its commit
    total_s: float = 0.0
    transfer: str = "object_store"  # how the KV went: "object_store" or "torch" (a torch.distributed channel)
    draft_tokens: int = 0  # tokens of draft KV moved (draft_kv: move); the destination's draft catches up on the rest
    draft_tokens_skipped: int = 0  # draft KV tokens its prefix cache held
    links: int = 0  # stage-to-stage links the KV went over (transfer "torch"; target and draft)


def plan_links(src_stages: list[tuple[int, ...]], dst_stages: list[tuple[int, ...]]
               ) -> list[tuple[int, int, tuple[int, ...]]]:
    """(source stage, destination stage, the layers they share) for every pair that shares any, in source order:
    the links that carry a request's KV between two splits of one model's layers (every layer exactly once)."""
    if sorted(i for ids in src_stages for i in ids) != sorted(i for ids in dst_stages for i in ids):
        raise ValueError(f"the two instances split different layers: {src_stages} and {dst_stages}")
    out = []
    for i, a in enumerate(src_stages):
        for j, b in enumerate(dst_stages):
            shared = tuple(layer for layer in a if layer in set(b))
            if shared:
                out.append((i, j, shared))
    return out


class StageStatus(str, enum.Enum):
    """What a stage of a migration returns: RUNNING, the next stage follows; any other, how the migration ended."""

    RUNNING = "running"
    FINISHED = MigrationStatus.FINISHED.value
    ABORTED_SRC = MigrationStatus.ABORTED_SRC.value
    ABORTED_DST = MigrationStatus.ABORTED_DST.value


@dataclass
class MigrationRun:
    """One migration's state, as its stages advance it: what the request's source held when last asked, what was
    copied, what the destination holds for it, how far the stop went, and why it ended."""

    request_id: str
    src: Endpoint  # each bounded by Deadlined in `migrate`
    dst: Endpoint
    cfg: MigrationConfig = MigrationConfig()
    destination: object = None  # what the source's stream is told at the release
    via: str | None = None  # the migration's channel (links), if one was opened
    progress: Callable[[MigrationProgress], None] = lambda p: None
    length: int = 0  # tokens of target KV the source held when last asked
    stages: int = 0  # copies made while the source kept decoding
    copied: int = 0  # target KV tokens the destination holds (its prefix cache's included)
    draft_tokens: int = 0  # draft KV tokens it holds
    draft_open: bool = True  # False once the destination cannot take more draft KV (its draft catches up)
    held: Reservation = Reservation()
    stop_sent: bool = False
    stopped: bool = False
    downtime_s: float = 0.0
    reason: str = ""
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.draft_open = self.cfg.draft_kv == "move"

    @property
    def lease_s(self) -> float:
        """What either end holds for this migration, it lets go of on its own after this long without a message."""
        return 2 * self.cfg.step_timeout_s

    @property
    def ready_to_stop(self) -> bool:
        return self.length - self.copied <= self.cfg.stop_copy_tokens

    def end(self, status: StageStatus, reason: str) -> StageStatus:
        self.reason = reason
        return status

    def reached(self, phase: str) -> None:
        self.progress(MigrationProgress(self.request_id, phase, self.stages, self.copied - self.held.cached_tokens))

    def result(self, status: StageStatus) -> MigrationResult:
        if status is StageStatus.RUNNING:
            raise ValueError("a migration still running has no result")
        held = self.held
        moved, bpt = max(0, self.copied - held.cached_tokens), held.kv_bytes_per_token
        return MigrationResult(self.request_id, MigrationStatus(status.value), self.reason, self.stages, moved,
                               held.cached_tokens, moved * bpt, held.cached_tokens * bpt, self.downtime_s,
                               time.perf_counter() - self.t0, draft_tokens=self.draft_tokens - held.draft_cached_tokens,
                               draft_tokens_skipped=held.draft_cached_tokens)


async def migrate(request_id: str, src: Endpoint, dst: Endpoint, cfg: MigrationConfig = MigrationConfig(),
                  destination: object = None, ids: tuple[str, str] | None = None,
                  progress: Callable[[MigrationProgress], None] = lambda p: None) -> MigrationResult:
    """Move a running request from `src` to `dst`; `destination` is what the source's stream is told (the
    destination instance's id and handle, for the client's stream to follow). With `cfg.transfer == "torch"`
    and the two instances' `ids`, the KV goes over a torch.distributed channel between them, opened for this
    migration alone (the object store if it cannot be opened): migrations between the same two instances may
    run side by side, each over its own channel. Every call to either end answers within `cfg.step_timeout_s`,
    or the migration aborts (Deadlined)."""
    run = MigrationRun(request_id, Deadlined(src, Side.SRC, cfg.step_timeout_s),
                       Deadlined(dst, Side.DST, cfg.step_timeout_s), cfg, destination, progress=progress)
    status = await probe(run)
    if status is not StageStatus.RUNNING:
        return run.result(status)
    # a queued request holds no KV (length 0): a channel would carry nothing
    links = 0
    if cfg.transfer == "torch" and ids and run.length:
        run.via, links = await _open_channel(run.src, run.dst, ids, request_id, cfg)
    try:
        result = await _migrate(run)
    finally:
        if run.via is not None:
            await _close_channel(run.src, run.dst, run.via)
    return dataclasses.replace(result, transfer="torch" if run.via else "object_store", links=links,
                               total_s=time.perf_counter() - run.t0)


async def _migrate(run: MigrationRun) -> MigrationResult:
    """The stages of a migration whose source holds the request (`probe` went through)."""
    status = await handshake(run)
    while status is StageStatus.RUNNING and run.stages < run.cfg.max_stages:
        status = await copy_stage(run)
        if run.ready_to_stop:
            break
    if status is StageStatus.RUNNING:
        status = await stop_and_commit(run)
    if status is StageStatus.RUNNING:
        status = await release(run)
    return run.result(status)


# ---- the stages: each returns RUNNING or how the migration ended, having undone what it must ------------------
async def probe(run: MigrationRun) -> StageStatus:
    """Source: how much KV the request holds now; aborted if it does not run there (nothing is held anywhere yet)."""
    try:
        length = await run.src.migration(Length(run.request_id))
    except Exception as e:  # noqa: BLE001 - the source failed: nothing was reserved anywhere
        return run.end(StageStatus.ABORTED_SRC, f"source: {type(e).__name__}: {e}")
    if length is None:
        return run.end(StageStatus.ABORTED_SRC, "the request does not run at the source")
    run.length = length
    return StageStatus.RUNNING


async def handshake(run: MigrationRun) -> StageStatus:
    """The source names the request's blocks; the destination reserves room for it (starting from what its prefix
    cache holds under those names), or refuses."""
    rid = run.request_id
    try:
        names = await run.src.migration(Names(rid))
    except Exception as e:  # noqa: BLE001 - the source failed: nothing was reserved anywhere
        return run.end(StageStatus.ABORTED_SRC, f"source: {type(e).__name__}: {e}")
    try:
        held = await run.dst.migration(Reserve(rid, run.length + run.cfg.stop_copy_tokens, run.lease_s, names))
        if held is None:
            return run.end(StageStatus.ABORTED_DST, "the destination has no room")
        run.held = held
        run.copied, run.draft_tokens = held.cached_tokens, held.draft_cached_tokens  # the copies start after them
        run.reached("reserved")
    except Exception as e:  # noqa: BLE001 - a reservation that timed out is dropped, there or by its lease
        await _drop(run.dst, rid)
        return run.end(StageStatus.ABORTED_DST, f"destination: {type(e).__name__}: {e}")
    return StageStatus.RUNNING


async def copy_stage(run: MigrationRun) -> StageStatus:
    """One stage while the source keeps decoding: copy what it held at the stage's start, in chunks of at most
    `chunk_tokens`, each between two of its steps (with the draft's next chunk), then ask what it holds now."""
    rid, cfg = run.request_id, run.cfg
    try:
        while run.copied < run.length:
            exported, _ = await asyncio.gather(
                _ask(run.src, Export(rid, Pipeline.TARGET, run.copied, min(run.length, run.copied + cfg.chunk_tokens),
                                     run.via)),
                _draft_chunk(run))
            if exported is None:
                await _drop(run.dst, rid)
                return run.end(StageStatus.ABORTED_SRC, "the request ended at the source first")
            kv, end = exported
            if not await _ask(run.dst, Import(Pipeline.TARGET, kv)):
                await _drop(run.dst, rid)
                return run.end(StageStatus.ABORTED_DST, "the destination ran out of KV blocks")
            run.copied = end
            run.reached("copying")
        run.stages += 1
        length = await _ask(run.src, Length(rid))
        if length is None:
            await _drop(run.dst, rid)
            return run.end(StageStatus.ABORTED_SRC, "the request ended at the source first")
        run.length = length
    except Exception as e:  # noqa: BLE001 - any failure before the stop: the request stays at the source
        return await _abort(run, e)
    return StageStatus.RUNNING


async def stop_and_commit(run: MigrationRun) -> StageStatus:
    """The downtime: the draft's last KV, the request stopped at the source with the rest of its KV, which the
    destination imports before it commits (the request resumes there)."""
    rid = run.request_id
    try:
        while await _draft_chunk(run) == run.cfg.chunk_tokens:  # what the draft added since its last chunk
            pass
        t_stop = time.perf_counter()
        run.stop_sent = True
        stopped = await _ask(run.src, Stop(rid, run.copied, run.via, run.lease_s))
        if stopped is None:
            await _drop(run.dst, rid)
            return run.end(StageStatus.ABORTED_SRC, "the request ended at the source first")
        run.stopped = True
        run.reached("stopped")
        request, rest, end, waited = stopped
        if not await _ask(run.dst, Import(Pipeline.TARGET, rest)) or not await _ask(run.dst, Commit(request)):
            raise _Failed(Side.DST, RuntimeError("the destination refused the request's last KV or its commit"))
        run.copied = end
        run.reached("committed")
        run.downtime_s = time.perf_counter() - t_stop - waited
    except Exception as e:  # noqa: BLE001 - any failure before the commit: the request stays at the source
        return await _abort(run, e)
    return StageStatus.RUNNING


async def release(run: MigrationRun) -> StageStatus:
    """The source frees the request and points its stream at the destination; if it cannot (it failed, or no longer
    holds the request stopped), nothing follows the committed copy, which is dropped."""
    rid = run.request_id
    try:
        released = await run.src.migration(Release(rid, True, run.destination))
    except Exception as e:  # noqa: BLE001 - the source died after the commit: its client's stream fails over
        return await _drop_committed(run, f"source failed before its release: {type(e).__name__}: {e}; the "
                                          "committed copy was cancelled and the stream fails over")
    if released is False:  # nothing follows the copy: the client left, or the source's lease ran out
        return await _drop_committed(run, "the request ended at the source while it moved (its client left); the "
                                          "committed copy was cancelled")
    return StageStatus.FINISHED


# ---- what the stages share ---------------------------------------------------------------------------------------
class _Failed(Exception):
    """A call to one end failed: which end it was (for the migration's status) and the error."""

    def __init__(self, side: Side, error: Exception) -> None:
        super().__init__(f"{side.word}: {type(error).__name__}: {error}")
        self.side, self.error = side, error


async def _ask(end: Deadlined, msg) -> object:
    """`end`'s answer to `msg`; its failure (a timeout included) as _Failed, naming the end."""
    try:
        return await end.migration(msg)
    except Exception as e:  # noqa: BLE001 - raised again, with the end named
        raise _Failed(end.side, e) from e


async def _draft_chunk(run: MigrationRun) -> int:
    """The draft's KV (`draft_kv: move`): copy its next chunk, if it has more than was copied; the tokens moved. The
    draft KV between steps is a prefix of the accepted tokens that never changes, so a copy made at any window
    between two of the source's steps stays right."""
    if not run.draft_open:
        return 0
    exported = await _ask(run.src, Export(run.request_id, Pipeline.DRAFT, run.draft_tokens,
                                          run.draft_tokens + run.cfg.chunk_tokens, run.via))
    if exported is None:
        return 0
    kv, end = exported
    if not await _ask(run.dst, Import(Pipeline.DRAFT, kv)):
        run.draft_open = False
        return 0
    moved, run.draft_tokens = end - run.draft_tokens, end
    return moved


async def _abort(run: MigrationRun, e: Exception) -> StageStatus:
    """A failure before the commit: the destination drops what it holds, and a request stopped at the source (or
    perhaps stopped: its stop timed out) resumes there."""
    side, error = (e.side, e.error) if isinstance(e, _Failed) else (Side.SRC, e)
    await _drop(run.dst, run.request_id)  # also cancels a commit that timed out here and landed after all
    # a stop that timed out may have stopped the request all the same: resume it (a no-op if it did not)
    if run.stopped and side is Side.DST or run.stop_sent and isinstance(error, StepTimeout):
        try:
            await run.src.migration(Release(run.request_id, False, None))
        except Exception:  # noqa: BLE001 - the source is gone or hung too: failover, or its lease, takes over
            log.exception("resuming %s at its source failed", run.request_id)
            return run.end(StageStatus.ABORTED_SRC, f"source lost after {side.word} failed: {error}")
    status = StageStatus.ABORTED_DST if side is Side.DST else StageStatus.ABORTED_SRC
    return run.end(status, f"{side.word}: {type(error).__name__}: {error}")


async def _drop_committed(run: MigrationRun, reason: str) -> StageStatus:
    """A copy was committed at the destination but the client's stream will not follow it there (the source
    failed before its release and the stream fails over from its own tokens, or the request ended at the source
    meanwhile), so the copy would run for nobody, or twice. Drop it."""
    log.warning("migration of %s: %s", run.request_id, reason)
    try:
        await run.dst.migration(Drop(run.request_id))
    except Exception as e:  # noqa: BLE001 - a dead destination runs nothing; a live one aborts a copy nobody follows
        log.warning("cancelling %s at the destination failed (%s: %s)", run.request_id, type(e).__name__, e)
    return run.end(StageStatus.ABORTED_SRC, reason)


async def _drop(dst: Endpoint, request_id: str) -> None:
    try:
        await dst.migration(Drop(request_id))
    except Exception as e:  # noqa: BLE001 - a dead destination holds nothing; a live one that missed this (hung,
        # or its answer lost) frees the reservation when its lease runs out (actors/serving/server.py)
        log.warning("dropping %s at the destination failed (%s: %s)", request_id, type(e).__name__, e)


# ---- the migration's channel (`transfer: torch`) -----------------------------------------------------------------
async def _open_channel(src: Endpoint, dst: Endpoint, ids: tuple[str, str], request_id: str,
                        cfg: MigrationConfig) -> tuple[str | None, int]:
    """Open this migration's links between the two instances' stages, for the target's KV and (moving it) the
    draft's, all at once; the channel's id (what the source sends `via`) and the number of links, or (None, 0) to
    send the KV through the object store. A draft whose KV cannot go stage to stage takes the object store alone."""
    src_id, dst_id = ids
    channel = f"{src_id}->{dst_id}/{request_id}"
    pipelines = (Pipeline.TARGET, Pipeline.DRAFT) if cfg.draft_kv == "move" else (Pipeline.TARGET,)
    try:
        planned = await asyncio.gather(*(_plan_links(src, dst, channel, p) for p in pipelines))
        if planned[0] is None:
            raise RuntimeError("an instance's target KV cannot go stage to stage")
        opening = []
        for pipeline, got in zip(pipelines, planned):
            if got is not None:
                links, backend = got
                opening += [end.migration(OpenLinks(channel, pipeline, tuple(links), side, cfg.channel_timeout_s,
                                                    backend))
                            for end, side in ((src, Side.SRC), (dst, Side.DST))]
        # every end to its end (each bounded by the timeout), so that none is still opening when they are closed
        ends = await asyncio.wait_for(asyncio.gather(*opening, return_exceptions=True), cfg.channel_timeout_s + 5)
        for failed in (e for e in ends if isinstance(e, BaseException)):
            raise failed
        return channel, sum(len(got[0]) for got in planned if got is not None)
    except Exception as e:  # noqa: BLE001 - the object store still carries the KV
        log.warning("no KV links for %s (%s: %s); the KV goes through the object store", channel, type(e).__name__, e)
        await _close_channel(src, dst, channel)
        return None, 0


async def _plan_links(src: Endpoint, dst: Endpoint, channel: str, pipeline: Pipeline
                      ) -> tuple[list[Link], str] | None:
    """The links of `pipeline` between the two instances' stages, with their addresses, and their backend; None if
    either has no such pipeline or its KV cannot go stage to stage."""
    a, b = await asyncio.gather(src.migration(KVLayout(pipeline)), dst.migration(KVLayout(pipeline)))
    if a is None or b is None:
        return None
    pairs = plan_links(a.stages, b.stages)
    addresses = await src.migration(LinkAddresses(pipeline, tuple(i for i, _, _ in pairs)))
    return [Link(f"{channel}/{pipeline}/{i}->{j}", i, j, layers, address)
            for (i, j, layers), address in zip(pairs, addresses, strict=True)], channel_backend([a.device, b.device])


def channel_backend(devices: list[str]) -> str:
    """NCCL when both instances keep a pipeline's KV on GPUs (device to device), gloo otherwise (host memory)."""
    return "nccl" if all(d == "cuda" for d in devices) else "gloo"


async def _close_channel(src: Endpoint, dst: Endpoint, channel: str) -> None:
    for end in (src, dst):
        try:
            await end.migration(CloseChannel(channel))
        except Exception as e:  # noqa: BLE001 - a dead end holds no channel; a send that failed was already reported
            log.warning("closing the KV channel %s failed (%s: %s)", channel, type(e).__name__, e)
